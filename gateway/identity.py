"""Which workflow a tool call belongs to: pure rules over what the request carries.

In this order: the request `_meta[WORKFLOW_META_KEY]` (the agent names it per call), the
`Saga-Workflow` HTTP header (set once per client), else the MCP session the call came on (one
session, one workflow, under an id the gateway generates). A stateless request with neither has
no identity at all and is refused: guessing would join unrelated calls into one saga.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from typing import Any, Literal

from mcp_saga.schemas.events import WORKFLOW_HEADER, WORKFLOW_META_KEY, check_workflow_id

Source = Literal["meta", "header", "session"]


class NoWorkflow(ValueError):
    """The request names no valid workflow; the message tells the client how to name one."""


def session_workflow(session_id: str) -> str:
    """The workflow of an MCP session: the session id when it fits the contract, else a digest of it,
    so that every request of one session lands in the same workflow without the gateway keeping a map."""
    try:
        return check_workflow_id(f"gw-{session_id}")
    except ValueError:
        return f"gw-{hashlib.sha256(session_id.encode()).hexdigest()[:24]}"


def new_session_workflow() -> str:
    return f"gw-{secrets.token_hex(12)}"


def resolve_workflow(
    meta: Mapping[str, Any] | None, headers: Mapping[str, str] | None, session: str | None
) -> tuple[str, Source]:
    """The workflow id and where it came from; `NoWorkflow` when it is invalid or absent."""
    named = (meta or {}).get(WORKFLOW_META_KEY)
    if named is not None:
        return _checked(named, f"_meta[{WORKFLOW_META_KEY!r}]"), "meta"
    header = headers.get(WORKFLOW_HEADER.lower()) if headers is not None else None
    if header is not None:
        return _checked(header, f"header {WORKFLOW_HEADER}"), "header"
    if session is not None:
        return session, "session"
    raise NoWorkflow(
        f"this request names no workflow: send _meta[{WORKFLOW_META_KEY!r}] or the {WORKFLOW_HEADER} header, "
        "or connect with a session (the 2025 initialize handshake) so that the session is the workflow"
    )


def _checked(value: object, where: str) -> str:
    try:
        return check_workflow_id(value)
    except ValueError as exc:
        raise NoWorkflow(f"{exc} in {where}") from None
