"""Workers: perform compensations over MCP, one RQ job each, with warm sessions and the trust policy.

Exports resolve lazily, so that `from workers.queue import enqueue` (the coordinator's side)
does not import the MCP SDK and the worker machinery along with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.job import RetryableFailure, compensate, set_context
    from workers.process import run_worker
    from workers.sessions import CallTimeout, SessionError, SessionPool, TransportError
    from workers.trust import Refusal, check

_EXPORTS = {
    "RetryableFailure": "workers.job",
    "compensate": "workers.job",
    "set_context": "workers.job",
    "run_worker": "workers.process",
    "CallTimeout": "workers.sessions",
    "SessionError": "workers.sessions",
    "SessionPool": "workers.sessions",
    "TransportError": "workers.sessions",
    "Refusal": "workers.trust",
    "check": "workers.trust",
}
__all__ = [
    "CallTimeout",
    "Refusal",
    "RetryableFailure",
    "SessionError",
    "SessionPool",
    "TransportError",
    "check",
    "compensate",
    "run_worker",
    "set_context",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
