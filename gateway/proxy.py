"""One MCP server per registry server, forwarding to it and recording every successful tools/call.

This is the path for stdio (`saga gateway --stdio`) and for upstreams the gateway spawns; HTTP
upstreams go through `passthrough.py`, which shares the `Gateway`'s recording, listing and
lifecycle methods (`record`, `tools_page`, `annotate`, `signal`).

Built on the SDK's low-level `Server`, so the gateway speaks whatever protocol era its client
speaks, while the upstream session negotiates its own. Requests are forwarded with their params
as received (minus our `_meta` key) over one warm upstream session per registry server
(`runtime.sessions.AsyncSessions`), results come back as the upstream sent them, and
notifications the upstream sends on its own (`list_changed`, `resources/updated`) are relayed to
the gateway's live sessions of that endpoint. Each endpoint's `Server` knows only its own
upstream, so a client of `/mcp/payments` cannot reach any other server.

The SDK re-validates results and drops unknown fields, so `annotations.recovery` is put back
into the `tools/list` result by a middleware, after that validation (as `runtime.recovery_wire`
does for our own servers), together with the `_meta` mirror, the operator's overlay first.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
from mcp import Client
from mcp.server.caching import CACHEABLE_METHODS, CacheHint
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.shared.exceptions import MCPError
from mcp_saga.gateway.identity import NoWorkflow, new_session_workflow, resolve_workflow, session_workflow
from mcp_saga.gateway.recorder import NotRecordable, Recorder
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.publish import clip, started_entry, step_entry
from mcp_saga.runtime.recovery_wire import IDEMPOTENCY_META_KEY, RECOVERY_META_KEY, declaration_from_wire
from mcp_saga.runtime.sessions import GATEWAY_CLIENT, AsyncSessions, ProtocolError, SessionError
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import STEP_META_KEY, WORKFLOW_META_KEY
from mcp_saga.schemas.records import forward_key
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter

log = get_logger("gateway")
RAW = TypeAdapter(dict[str, Any])
FAIL_TOOL, COMPLETE_TOOL = "saga_fail", "saga_complete"
_NOT_STEP_CHARS = re.compile(r"[^A-Za-z0-9._:-]")
_SESSION_STATE = "io.github.mcp-saga/workflow"
# Requests forwarded as they are; list methods answer an empty page when the upstream lacks the capability.
_FORWARDED: list[tuple[str, type, type, str | None, str | None]] = [
    ("resources/list", types.PaginatedRequestParams, types.ListResourcesRequest, "resources", "resources"),
    (
        "resources/templates/list",
        types.PaginatedRequestParams,
        types.ListResourceTemplatesRequest,
        "resources",
        "resourceTemplates",
    ),
    ("resources/read", types.ReadResourceRequestParams, types.ReadResourceRequest, None, None),
    ("resources/subscribe", types.SubscribeRequestParams, types.SubscribeRequest, None, None),
    ("resources/unsubscribe", types.UnsubscribeRequestParams, types.UnsubscribeRequest, None, None),
    ("prompts/list", types.PaginatedRequestParams, types.ListPromptsRequest, "prompts", "prompts"),
    ("prompts/get", types.GetPromptRequestParams, types.GetPromptRequest, None, None),
    ("completion/complete", types.CompleteRequestParams, types.CompleteRequest, None, None),
]
_RELAYED = (
    types.ToolListChangedNotification,
    types.ResourceListChangedNotification,
    types.PromptListChangedNotification,
    types.ResourceUpdatedNotification,
)


def step_id(n: int, tool: str, instance: str) -> str:
    """`{n}-{tool}.{instance}`: readable, and unique across gateway restarts and replicas."""
    head = _NOT_STEP_CHARS.sub("_", f"{n}-{tool}")[: 63 - len(instance)]
    return f"{head}.{instance}"


class _Endpoint(Server[Any]):
    """A low-level server that announces `list_changed` for what it relays."""

    def create_initialization_options(self, notification_options: Any = None, *args: Any, **kwargs: Any) -> Any:
        options = notification_options or NotificationOptions(True, True, True)
        return super().create_initialization_options(options, *args, **kwargs)


class Gateway:
    """The registry's servers behind one recorder; `endpoint(name)` is the MCP server for one of them."""

    def __init__(self, config: Config, recorder: Recorder, *, stdio: bool = False) -> None:
        self.config = config
        self.settings = config.gateway
        self.recorder = recorder
        self.instance = secrets.token_hex(3)
        self.sessions = AsyncSessions(
            config.servers,
            tools_ttl=config.worker.tools_ttl,
            client_name=GATEWAY_CLIENT,
            message_handler=self._relay_for,
            # A handshake-era session keeps a stream open on which the upstream sends its own
            # notifications (list_changed, resources/updated) for the gateway to relay; a 2026-era
            # one delivers them only to an explicit subscriptions/listen.
            mode="legacy",
        )
        # A stdio gateway serves one host: the process is the session.
        self.stdio_workflow = new_session_workflow() if stdio else None
        self._steps = 0
        self._declared: dict[str, dict[str, Any]] = {name: {} for name in config.servers}
        self._schemas: dict[str, dict[str, Any]] = {name: {} for name in config.servers}
        self._worked_out: dict[tuple[str, str], tuple[Any, tuple[Any, dict[str, Any] | None]]] = {}
        self._downstream: dict[str, weakref.WeakKeyDictionary[Any, Any]] = {
            name: weakref.WeakKeyDictionary() for name in config.servers
        }
        self.endpoints = {name: self._build(name) for name in config.servers}

    # Building one endpoint.

    def _build(self, name: str) -> Server[Any]:
        server = _Endpoint(
            f"mcp-saga-gateway/{name}",
            version=GATEWAY_CLIENT,
            # Without it, the SDK runs the tools/list handler for every 2026-era call to check its
            # `Mcp-Param` headers: one more upstream round trip per call.
            get_tool_input_schema=lambda tool: self._schemas[name].get(tool),
            # A 2026-era client needs freshness hints a handshake-era upstream never sends: the
            # upstream's own win; where it sent none, "stale at once, not shared" claims nothing.
            cache_hints={method: CacheHint() for method in CACHEABLE_METHODS if method != "server/discover"},
            on_list_tools=lambda ctx, params: self._list_tools(name, ctx, params),
            on_call_tool=lambda ctx, params: self._call_tool(name, ctx, params),
        )
        for method, params_type, request_type, capability, listing in _FORWARDED:
            server.add_request_handler(method, params_type, self._forwarder(name, request_type, capability, listing))
        # The SDK's default OpenTelemetry span per message is a cost on every forwarded call; the
        # upstream server records its own spans, and the gateway logs what it records.
        server.middleware = [self._middleware(name)]
        return server

    def _middleware(self, name: str) -> Callable[..., Awaitable[Any]]:
        async def middleware(ctx: ServerRequestContext[Any, Any], call_next: Any) -> Any:
            connection = getattr(ctx.session, "_connection", None)  # the SDK exposes it only privately
            if connection is not None and ctx.request_id is not None:
                self._downstream[name][connection] = ctx.session
            log.debug("request", server=name, method=ctx.method)
            result = await call_next(ctx)
            if ctx.method == "tools/list" and isinstance(result, dict):
                self.annotate(name, result)
            return result

        return middleware

    def annotate(self, name: str, result: dict[str, Any]) -> None:
        """Recovery in the SEP's place and in the `_meta` mirror: the overlay, else what the upstream declared."""
        for tool in result.get("tools") or ():
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                continue
            recovery = self._recovery(name, tool["name"])
            if recovery is None:
                continue
            tool["annotations"] = {**(tool.get("annotations") or {}), "recovery": recovery}
            tool["_meta"] = {**(tool.get("_meta") or {}), RECOVERY_META_KEY: recovery}

    def _recovery(self, name: str, tool: str) -> Any:
        overlay = self.config.overlay(name, tool)
        return overlay.to_wire() if overlay is not None else self._declared[name].get(tool)

    # Forwarding.

    async def _upstream(
        self, name: str, ctx: ServerRequestContext[Any, Any], run: Callable[[Client], Awaitable[Any]]
    ) -> Any:
        """The upstream's result for the client's protocol era: a 2026 client needs `resultType`, which
        a handshake-era upstream never sends (absent means complete)."""
        try:
            result = await self.sessions.request(name, run)
            if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS and isinstance(result, dict):
                result.setdefault("resultType", "complete")
            return result
        except ProtocolError as exc:
            raise MCPError(code=exc.code, message=str(exc).removeprefix(f"MCP error {exc.code}: ")) from None
        except SessionError as exc:
            raise MCPError(code=types.INTERNAL_ERROR, message=f"upstream {name!r} did not answer: {exc}") from None

    def _forwarder(
        self, name: str, request_type: type, capability: str | None, listing: str | None
    ) -> Callable[..., Awaitable[Any]]:
        async def handler(ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
            async def run(client: Client) -> Any:
                if capability is not None and getattr(client.server_capabilities, capability, None) is None:
                    return {listing: []}
                request = request_type(params=_forwarded_params(params))
                return await client.session.send_request(request, RAW, progress_callback=_progress(ctx, params))

            return await self._upstream(name, ctx, run)

        return handler

    async def _list_tools(self, name: str, ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
        async def run(client: Client) -> Any:
            request = types.ListToolsRequest(params=_forwarded_params(params))
            return await client.session.send_request(request, RAW)

        page = await self._upstream(name, ctx, run)
        return self.tools_page(name, page, first_page=params is None or not getattr(params, "cursor", None))

    def tools_page(self, name: str, page: dict[str, Any], *, first_page: bool) -> dict[str, Any]:
        """Learn the upstream's declarations from a `tools/list` page, and add our tools to the first page."""
        tools = page.get("tools") if isinstance(page.get("tools"), list) else []
        for tool in tools:
            declaration = declaration_from_wire(tool) if isinstance(tool, dict) else None
            if declaration is None:
                continue
            self._schemas[name][declaration.name] = declaration.input_schema
            if declaration.recovery is not None:
                self._declared[name][declaration.name] = declaration.recovery
        if self.settings.tools and first_page:
            page = {**page, "tools": [*tools, *LIFECYCLE_TOOLS]}
        return page

    async def _call_tool(self, name: str, ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
        if self.is_lifecycle(params.name):
            return await self._lifecycle(ctx, params)
        workflow = self._workflow(ctx)
        try:
            await self.recorder.admit(workflow)
        except NotRecordable as exc:
            log.warning("call refused", workflow=workflow, server=name, tool=params.name, reason=str(exc))
            raise MCPError(code=types.INTERNAL_ERROR, message=str(exc)) from None
        arguments = params.arguments or {}
        try:
            step, extra = await self.intend(name, workflow, params.name, arguments, params.meta)
        except NotRecordable as exc:
            log.warning("call refused", workflow=workflow, server=name, tool=params.name, reason=str(exc))
            raise MCPError(code=types.INTERNAL_ERROR, message=str(exc)) from None

        async def run(client: Client) -> Any:
            request = types.CallToolRequest(params=_forwarded_params(params, extra))
            return await client.session.send_request(request, RAW, progress_callback=_progress(ctx, params))

        result = await self._upstream(name, ctx, run)
        if result.get("isError") or result.get("resultType") not in (None, "complete"):
            self.settle_failed(name, workflow, params.name, arguments, result, step)
            return result  # not a completed step: a failure, or a round that asks for input first
        step = await self.record(name, workflow, params.name, arguments, result, step)
        return stamped(result, workflow, step)

    def is_lifecycle(self, tool: object) -> bool:
        return self.settings.tools and tool in (FAIL_TOOL, COMPLETE_TOOL)

    async def intend(
        self, name: str, workflow: str, tool: str, arguments: dict[str, Any], meta: Any
    ) -> tuple[str | None, dict[str, Any]]:
        """Write the call's intent and wait for Redis to take it (issue 14), before the call is forwarded:
        (its step, the `_meta` to add upstream: the forward key). (None, {}) with `[gateway] intents`
        off. Raises `NotRecordable` when the intent cannot be written: the call must not go out."""
        if not self.settings.intents:
            return None, {}
        step = self._next_step(tool)
        key = dict(meta or {}).get(IDEMPOTENCY_META_KEY)
        key = key if isinstance(key, str) and key else forward_key(workflow, step)
        recovery, annotations = await self._declaration(name, workflow, step, tool)
        try:
            intent = started_entry(workflow, step, name, tool, arguments, recovery, annotations, key=key)
        except ValueError as exc:  # the client's own key breaks the contract (over 200 characters)
            message = f"the gateway could not record the intent of this call ({exc}); it was not forwarded"
            raise NotRecordable(message) from None
        await self.recorder.started(workflow, step, intent)
        return step, {IDEMPOTENCY_META_KEY: key}

    def settle_failed(
        self, name: str, workflow: str, tool: str, arguments: dict[str, Any], result: dict[str, Any], step: str | None
    ) -> None:
        """An error answer settles the call's intent as nothing done; a round that asks for input leaves it open."""
        if step is not None and result.get("isError"):
            fields = step_entry(workflow, step, name, tool, arguments, result)
            self.recorder.completed(workflow, step, fields, failed=True)

    def _next_step(self, tool: str) -> str:
        self._steps += 1
        return step_id(self._steps, tool, self.instance)

    async def record(
        self,
        name: str,
        workflow: str,
        tool: str,
        arguments: dict[str, Any],
        result: dict[str, Any],
        step: str | None = None,
        *,
        answered: asyncio.Future[None] | None = None,
    ) -> str:
        """Queue the step-completed of a call that succeeded; a step that cannot be recorded poisons its workflow.

        Its entry is built (encoded, checked) and written once `answered` is done (the client has its
        answer): the result is not changed afterwards (`stamped` copies it), so the step holds what
        the upstream returned."""
        step = step or self._next_step(tool)
        recovery, annotations = await self._declaration(name, workflow, step, tool)

        def entry() -> dict[bytes, bytes]:
            return step_entry(workflow, step, name, tool, arguments, result, recovery, annotations)

        self.recorder.completed(workflow, step, entry, after=answered)
        return step

    async def _declaration(self, name: str, workflow: str, step: str, tool: str) -> tuple[Any, dict[str, Any] | None]:
        """(recovery, annotations) as the step's events carry them: the overlay first, else the live listing."""
        recovery, annotations = self._recovery(name, tool), None
        try:
            listing = await self.sessions.tools(name)
        except SessionError as exc:  # the call committed: record it, with the overlay if there is one
            log.warning(
                "tools/list failed; step recorded without the live declaration",
                workflow=workflow,
                step=step,
                error=str(exc),
            )
            return recovery, annotations
        # Worked out once per tool and listing (a refreshed listing is a new dict): twice per call otherwise.
        known = self._worked_out.get((name, tool))
        if known is not None and known[0] is listing:
            return known[1]
        declaration = listing.get(tool)
        if declaration is not None:
            self._schemas[name].setdefault(tool, declaration.input_schema)
            if recovery is None:
                recovery = declaration.recovery
                if recovery is not None and not isinstance(recovery, dict):
                    recovery = {"declared": recovery}  # kept visible; the coordinator plans it as unrecoverable
            annotations = {k: v for k, v in declaration.annotations.items() if k != "recovery"} or None
            # Only tools of the listing: a name the client made up must not grow this.
            self._worked_out[name, tool] = (listing, (recovery, annotations))
        return recovery, annotations

    async def _lifecycle(self, ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
        workflow = self._workflow(ctx)
        text = await self.signal(workflow, params.name, params.arguments or {})
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], meta={WORKFLOW_META_KEY: workflow}
        )

    async def signal(self, workflow: str, tool: str, arguments: dict[str, Any]) -> str:
        """Publish what a lifecycle tool says (`saga_fail` / `saga_complete`); the text tells the agent it did."""
        try:
            if tool == FAIL_TOOL:
                reason = clip(str(arguments.get("reason") or "the agent called saga_fail"))
                await self.recorder.fail(workflow, reason)
                return f"workflow {workflow}: failure recorded; its completed steps will be compensated"
            await self.recorder.complete(workflow)
            return f"workflow {workflow}: completed"
        except Exception as exc:
            log.error("lifecycle signal not published", workflow=workflow, tool=tool, error=repr(exc))
            raise MCPError(code=types.INTERNAL_ERROR, message=f"could not record {tool}: {exc}") from None

    def _workflow(self, ctx: ServerRequestContext[Any, Any]) -> str:
        request = ctx.request
        headers = getattr(request, "headers", None)
        try:
            workflow, _ = resolve_workflow(ctx.meta, headers, self._session_workflow(ctx))
        except NoWorkflow as exc:
            raise MCPError(code=types.INVALID_PARAMS, message=str(exc)) from None
        return workflow

    def _session_workflow(self, ctx: ServerRequestContext[Any, Any]) -> str | None:
        if self.stdio_workflow is not None:
            return self.stdio_workflow
        connection = getattr(ctx.session, "_connection", None)
        if connection is None or connection.session_id is None:
            return None  # stateless: no session to stand for the workflow
        workflow = connection.state.get(_SESSION_STATE)
        if workflow is None:
            workflow = connection.state[_SESSION_STATE] = session_workflow(connection.session_id)
            policy = self.settings.on_session_end
            connection.exit_stack.push_async_callback(self.recorder.apply_policy, workflow, policy, "session ended")
        return workflow

    # Notifications the upstream sends on its own.

    def _relay_for(self, name: str) -> Callable[[Any], Awaitable[None]]:
        async def relay(message: Any) -> None:
            if not isinstance(message, _RELAYED):
                return
            if isinstance(message, types.ToolListChangedNotification):
                self.sessions.forget_tools(name)
            for session in list(self._downstream[name].values()):
                try:
                    await session.send_notification(message)
                except Exception as exc:  # a client gone away must not stop the others hearing it
                    log.debug("notification not relayed", server=name, error=repr(exc))

        return relay


def stamped(result: dict[str, Any], workflow: str, step: str) -> dict[str, Any]:
    """The upstream's result, its `_meta` telling the client which workflow and step the call became."""
    return {**result, "_meta": {**(result.get("_meta") or {}), WORKFLOW_META_KEY: workflow, STEP_META_KEY: step}}


def _forwarded_params(params: Any, extra: dict[str, Any] | None = None) -> Any:
    """The params as received, minus our workflow key and the client's progress token (the upstream gets its own),
    plus `extra` (the call's forward key)."""
    if params is None:
        return None
    meta = {**dict(params.meta or {}), **(extra or {})}
    meta.pop(WORKFLOW_META_KEY, None)
    meta.pop("progress_token", None)  # the validated meta holds the token under its Python name
    return params.model_copy(update={"meta": meta or None})


def _progress(ctx: ServerRequestContext[Any, Any], params: Any) -> Any:
    """Relay the upstream's progress to the client, when the client asked for progress."""
    if params is None or (params.meta or {}).get("progress_token") is None:
        return None

    async def report(progress: float, total: float | None, message: str | None) -> None:
        await ctx.session.report_progress(progress, total, message)

    return report


LIFECYCLE_TOOLS: list[dict[str, Any]] = [
    {
        "name": FAIL_TOOL,
        "description": "Tell the saga coordinator this workflow failed: every step completed so far is undone, "
        "newest first. Call it once, when the task cannot be finished.",
        "inputSchema": {
            "type": "object",
            "properties": {"reason": {"type": "string", "description": "why the workflow failed"}},
            "required": ["reason"],
        },
        "annotations": {"destructiveHint": True, "idempotentHint": True},
    },
    {
        "name": COMPLETE_TOOL,
        "description": "Tell the saga coordinator this workflow finished: nothing will be undone.",
        "inputSchema": {"type": "object", "properties": {}},
        "annotations": {"idempotentHint": True},
    },
]
