"""How SEP-3172 recovery metadata travels over MCP 2.x, in both directions.

The SDK re-validates every `tools/list` result against the protocol schema, which has no
`annotations.recovery`, so a declaration made through `ToolAnnotations` never reaches the wire, and
`Client.list_tools()` drops it again on the way in. The server half therefore registers each
declaration twice: under `_meta[RECOVERY_META_KEY]`, which the schema keeps, and, through one
middleware per server that runs after that validation, as `annotations.recovery` in the SEP's own
shape. The client half reads the raw listing and accepts either place, preferring the SEP's.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import mcp_types
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery
from pydantic import BaseModel, TypeAdapter

if TYPE_CHECKING:
    from mcp import Client
    from mcp.client.session import ClientSession
    from mcp.server.mcpserver import Context, MCPServer

# Reverse-DNS keys of our own: the `mcp`/`modelcontextprotocol` second labels are reserved.
RECOVERY_META_KEY = "io.github.mcp-saga/recovery"
IDEMPOTENCY_META_KEY = "io.github.mcp-saga/idempotency-key"
# Tools that cannot read request `_meta` may declare this optional argument instead.
IDEMPOTENCY_ARGUMENT = "idempotencyKey"

# A hostile server could hand out cursors forever; no honest listing needs this many pages.
MAX_LIST_PAGES = 1000

RecoverySource = Literal["annotations", "meta"]
_F = TypeVar("_F", bound=Callable[..., Any])
_RAW = TypeAdapter(dict[str, Any])
log = logging.getLogger(__name__)


def compensation(operation_id: str, /, **parameters: Any) -> dict[str, Any]:
    """Spell the common case in one line; the result is the SEP wire form."""
    return {
        "strategy": "compensation",
        "compensatingOperation": {"operationId": operation_id, "parameters": parameters},
    }


class RecoveryAnnotations:
    """Server middleware that adds `annotations.recovery` to the `tools/list` result.

    It has to run after the SDK has validated the result, which is exactly where a middleware's
    `call_next` returns; install it with `recoverable_tool`, which keeps one per server.
    """

    def __init__(self) -> None:
        self.declared: dict[str, dict[str, Any]] = {}
        self._warned: set[str] = set()

    async def __call__(self, ctx: Any, call_next: Callable[[Any], Any]) -> Any:
        result = await call_next(ctx)
        if ctx.method != "tools/list" or not self.declared:
            return result
        if isinstance(result, BaseModel):
            result = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            return result
        listed = {tool.get("name") for tool in tools if isinstance(tool, dict)}
        for tool in tools:
            recovery = self.declared.get(tool.get("name")) if isinstance(tool, dict) else None
            if recovery is None:
                continue
            tool["annotations"] = {**(tool.get("annotations") or {}), "recovery": copy.deepcopy(recovery)}
            self._warn_missing_target(tool["name"], recovery, listed)
        return result

    def _warn_missing_target(self, name: str, recovery: dict[str, Any], listed: set[Any]) -> None:
        # Only visible once the whole server is built, so this is a log line rather than an import error.
        target = recovery.get("compensatingOperation", {}).get("operationId")
        if target and target not in listed and name not in self._warned:
            self._warned.add(name)
            log.warning("tool %r declares compensation by %r, which this server does not list", name, target)


def recovery_middleware(app: MCPServer) -> RecoveryAnnotations:
    """The server's `RecoveryAnnotations`, installed on first use so that it runs once per request."""
    for middleware in app.middleware:
        if isinstance(middleware, RecoveryAnnotations):
            return middleware
    middleware = RecoveryAnnotations()
    app.middleware.append(middleware)
    return middleware


def recoverable_tool(
    app: MCPServer,
    recovery: Recovery | Mapping[str, Any] | None = None,
    **tool_kwargs: Any,
) -> Callable[[_F], _F]:
    """Register a tool like `app.tool(**tool_kwargs)` and declare how to undo it.

    The declaration is validated here, so a typo fails when the server module is imported, with
    the tool's name in the message, instead of surfacing later as an unrecoverable step.
    """

    def decorator(fn: _F) -> _F:
        kwargs = dict(tool_kwargs)
        name = kwargs.get("name") or fn.__name__
        meta = dict(kwargs.pop("meta", None) or {})
        if recovery is not None:
            wire = parse_recovery(recovery, where=f"tool {name!r}: recovery").to_wire()
            meta[RECOVERY_META_KEY] = wire
            recovery_middleware(app).declared[name] = wire
        app.tool(**kwargs, meta=meta or None)(fn)
        return fn

    return decorator


def idempotency_key(ctx: Context[Any, Any]) -> str | None:
    """The caller's idempotency key from the request `_meta`, or None when it sent none."""
    try:
        meta = ctx.request_context.meta
    except ValueError:
        return None
    key = meta.get(IDEMPOTENCY_META_KEY) if meta else None
    return key if isinstance(key, str) and key else None


@dataclass(frozen=True, slots=True)
class ToolDeclaration:
    """One `tools/list` entry as the server sent it, with its recovery located and checked.

    `recovery` is the declaration exactly as found (also when invalid, so that it can be shown and
    recorded); `problem` says why it cannot be trusted as is, or that the two places disagree.
    """

    name: str
    input_schema: dict[str, Any] = field(default_factory=dict)
    output_schema: dict[str, Any] | None = None
    annotations: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    recovery: Any = None
    recovery_source: RecoverySource | None = None
    problem: str | None = None

    def parsed_recovery(self) -> Recovery | None:
        """The validated model, or None when there is no declaration or it is invalid."""
        if self.recovery is None:
            return None
        try:
            return parse_recovery(self.recovery, where=f"tool {self.name!r}: recovery")
        except RecoveryError:
            return None

    def declares_argument(self, name: str) -> bool:
        properties = self.input_schema.get("properties")
        return isinstance(properties, dict) and name in properties


def declaration_from_wire(tool: Mapping[str, Any]) -> ToolDeclaration | None:
    """Build a `ToolDeclaration` from one raw entry; None when the entry has no usable name."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        return None
    annotations = _as_dict(tool.get("annotations"))
    meta = _as_dict(tool.get("_meta"))
    output_schema = tool.get("outputSchema")
    in_annotations, in_meta = annotations.get("recovery"), meta.get(RECOVERY_META_KEY)
    problems = []
    if in_annotations is not None:
        recovery, source = in_annotations, "annotations"
        if in_meta is not None and in_meta != in_annotations:
            problems.append(
                f"annotations.recovery and _meta[{RECOVERY_META_KEY!r}] differ; "
                "using annotations.recovery, as the SEP defines it"
            )
    elif in_meta is not None:
        recovery, source = in_meta, "meta"
    else:
        recovery, source = None, None
    if recovery is not None:
        try:
            parse_recovery(recovery, where=f"tool {name!r}: recovery")
        except RecoveryError as exc:
            problems.append(f"invalid recovery declaration: {exc}")
    return ToolDeclaration(
        name=name,
        input_schema=_as_dict(tool.get("inputSchema")),
        output_schema=output_schema if isinstance(output_schema, dict) else None,
        annotations=annotations,
        meta=meta,
        recovery=recovery,
        recovery_source=source,
        problem="; ".join(problems) or None,
    )


async def read_tool_declarations(client: Client | ClientSession) -> dict[str, ToolDeclaration]:
    """List every tool of a connected server, page by page, recovery included.

    Goes around `Client.list_tools()`, which drops `annotations.recovery`, and never raises for a
    bad declaration: those come back with `problem` set. Protocol errors still raise.
    """
    session = client if hasattr(client, "send_request") else client.session
    declarations: dict[str, ToolDeclaration] = {}
    cursor: str | None = None
    seen_cursors: set[str] = set()
    for _ in range(MAX_LIST_PAGES):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.send_request(mcp_types.ListToolsRequest(params=params), _RAW)
        tools = page.get("tools")
        for tool in tools if isinstance(tools, list) else ():
            declaration = declaration_from_wire(tool) if isinstance(tool, dict) else None
            if declaration is None:
                continue
            if declaration.name in declarations:
                log.warning("server lists tool %r more than once; keeping the first", declaration.name)
                continue
            declarations[declaration.name] = declaration
        cursor = page.get("nextCursor")
        if not isinstance(cursor, str) or not cursor:
            return declarations
        if cursor in seen_cursors:
            log.warning("server repeated tools/list cursor %r; stopping there", cursor)
            return declarations
        seen_cursors.add(cursor)
    log.warning("tools/list went past %d pages; stopping there", MAX_LIST_PAGES)
    return declarations


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
