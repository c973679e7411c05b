"""`/mcp/<server>` for an upstream reached over streamable HTTP: a JSON-RPC pass-through at the ASGI level.

The gateway as a full MCP server (SDK `Server` and session machinery in front of an SDK client
per upstream) cost more than the 2 ms tool it forwarded: every message parsed, validated and
re-serialised twice, and a new upstream connection per call. Here each HTTP request (POST, GET,
DELETE) goes to the registry's URL for that endpoint as it came, over a pooled keep-alive client,
and the answer (JSON or SSE) streams back as it comes. The gateway reads only what it must:

- a `tools/call`: the workflow is resolved and the call admitted before it is forwarded (refused
  while Redis is down), our `_meta` key is taken out, and the matching response in the answer is
  recorded (`Gateway.record`) and stamped with the workflow and step before the client sees it;
  our lifecycle tools are answered here and never forwarded;
- a `tools/list`: the matching response gets the recovery wire form, the `_meta` mirror (the
  overlay first) and our optional tools (`Gateway.tools_page`, `Gateway.annotate`);
- a DELETE (the client ends its session): the session's workflow gets the `on_session_end` policy.

MCP sessions are then the upstream's own: one `Mcp-Session-Id`, one workflow. Only the headers
MCP defines go upstream (never the client's token, Host or cookies), plus the registry's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import mcp_types as types
from mcp.server.transport_security import TransportSecurityMiddleware
from mcp.shared.exceptions import MCPError
from mcp_saga.gateway import wire
from mcp_saga.gateway.identity import NoWorkflow, resolve_workflow, session_workflow
from mcp_saga.gateway.proxy import Gateway, stamped
from mcp_saga.gateway.recorder import NotRecordable
from mcp_saga.runtime.http_client import Target, UpstreamError, Upstreams
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.sessions import GATEWAY_CLIENT, client_info
from mcp_saga.schemas.config import ConfigError
from mcp_saga.schemas.events import WORKFLOW_HEADER, WORKFLOW_META_KEY
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

log = get_logger("gateway")
# What a client may tell the upstream: the body's type and the MCP headers (session, protocol
# version, the 2026 `Mcp-Method` / `Mcp-Name` / `Mcp-Param-*`), and where a resumed stream stands.
_REQUEST_HEADERS = frozenset({b"content-type", b"accept", b"last-event-id"})
_RESPONSE_HEADERS = frozenset({b"content-type", b"cache-control", b"content-length"})
_METHODS = ("GET", "POST", "DELETE")
_LIST_CHANGED = b"notifications/tools/list_changed"
_JSON = [(b"content-type", b"application/json")]
_CHECKED = (b"host", b"origin", b"content-type")
_PASSED_MAX = 256  # distinct (Host, Origin, Content-Type) that passed, kept per endpoint
WATCH_AFTER = 0.1  # seconds a request runs before the gateway watches for its client going away
Edit = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class PassThrough:
    """The ASGI app of one endpoint whose registry server has a `url`."""

    def __init__(
        self,
        gateway: Gateway,
        name: str,
        http: Upstreams,
        security: TransportSecurityMiddleware | None = None,
    ) -> None:
        config = gateway.config.servers[name]
        assert config.url is not None
        self.gateway, self.name, self.http, self.security = gateway, name, http, security
        self.target = Target.of(config.url)
        self.client = client_info(GATEWAY_CLIENT).model_dump(mode="json", exclude_none=True)
        self.own_headers = [(k.lower().encode(), v.encode()) for k, v in config.headers().items()]
        if any(b"\r" in k + v or b"\n" in k + v for k, v in self.own_headers):
            raise ConfigError(f"server {name!r}: a header from the environment holds a line break")
        self.timeout = config.timeout
        self._passed: dict[tuple[bytes | None, ...], None] = {}

    def security_passed(self, scope: Scope, is_post: bool) -> bool:
        """Whether the SDK's Host / Origin / Content-Type checks passed for exactly these header values
        before: a client sends the same three on every request, and the verdict depends on nothing
        else, so it is worked out once (the SDK's own check, never a copy of its rules). Only passes
        are kept, at most `_PASSED_MAX`: a refusal is worked out (and logged) each time."""
        if len(self._passed) >= _PASSED_MAX:
            self._passed.clear()
        return _checked_headers(scope, is_post) in self._passed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method = scope["method"]
        if method not in _METHODS:
            await _answer(send, 405, b'{"error": "method not allowed"}', [(b"allow", b"GET, POST, DELETE")])
            return
        if self.security is not None and not self.security_passed(scope, method == "POST"):
            refusal = await self.security.validate_request(Request(scope), is_post=method == "POST")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
            self._passed[_checked_headers(scope, method == "POST")] = None
        headers: dict[bytes, bytes] = dict(scope["headers"])
        body = await _body(receive) if method == "POST" else b""
        try:
            peeked = wire.peek(body) if method == "POST" else None
        except wire.Unreadable as exc:
            await _answer(send, 400, wire.error_response(None, exc.code, str(exc)), _JSON)
            return
        watch = _Watch(receive)
        try:
            if peeked is None:
                await self._forward(method, headers, body, send, watch)
            elif peeked.method == "tools/call":
                await self._call(peeked, headers, body, send, watch)
            else:
                edit = self._tools_list(peeked) if peeked.method == "tools/list" else None
                await self._forward(method, headers, self._body(peeked, body), send, watch, peeked.id, edit)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            log.debug("client went away; upstream request closed", server=self.name)
        finally:
            watch.close()
        session = headers.get(b"mcp-session-id")
        if method == "DELETE" and session is not None:
            workflow = session_workflow(session.decode("latin-1"))
            await self.gateway.recorder.apply_policy(workflow, self.gateway.settings.on_session_end, "session ended")
            self.gateway.recorder.forget(workflow)

    async def _call(
        self, peeked: wire.Peeked, headers: dict[bytes, bytes], body: bytes, send: Send, watch: _Watch
    ) -> None:
        gateway, params = self.gateway, peeked.params
        tool, meta = params.get("name"), params.get("_meta")
        session = headers.get(b"mcp-session-id")
        named = headers.get(WORKFLOW_HEADER.lower().encode())
        try:
            workflow, _ = resolve_workflow(
                meta if isinstance(meta, dict) else None,
                {WORKFLOW_HEADER.lower(): named.decode("latin-1")} if named is not None else {},
                session_workflow(session.decode("latin-1")) if session is not None else None,
            )
        except NoWorkflow as exc:
            await _answer(send, 200, wire.error_response(peeked.id, types.INVALID_PARAMS, str(exc)), _JSON)
            return
        if gateway.is_lifecycle(tool):
            await self._lifecycle(peeked, workflow, headers, send)
            return
        try:
            await gateway.recorder.admit(workflow)
        except NotRecordable as exc:
            log.warning("call refused", workflow=workflow, server=self.name, tool=tool, reason=str(exc))
            await _answer(send, 200, wire.error_response(peeked.id, types.INTERNAL_ERROR, str(exc)), _JSON)
            return
        arguments = params.get("arguments") or {}
        try:
            step, extra = await gateway.intend(self.name, workflow, str(tool), arguments, meta)
        except NotRecordable as exc:
            log.warning("call refused", workflow=workflow, server=self.name, tool=tool, reason=str(exc))
            await _answer(send, 200, wire.error_response(peeked.id, types.INTERNAL_ERROR, str(exc)), _JSON)
            return

        # Done once the client has its answer (or the exchange ended otherwise): the step's entry is built
        # and written then, not on the call's path.
        answered = asyncio.get_running_loop().create_future()

        async def record(message: dict[str, Any]) -> dict[str, Any]:
            result = message.get("result")
            if not isinstance(result, dict):
                return message
            if result.get("isError") or result.get("resultType") not in (None, "complete"):
                gateway.settle_failed(self.name, workflow, str(tool), arguments, result, step)
                return message  # not a completed step: a failure, or a round that asks for input first
            recorded = await gateway.record(self.name, workflow, str(tool), arguments, result, step, answered=answered)
            return {**message, "result": stamped(result, workflow, recorded)}

        try:
            await self._forward("POST", headers, self._body(peeked, body, extra), send, watch, peeked.id, record)
        finally:
            answered.set_result(None)

    def _body(self, peeked: wire.Peeked, body: bytes, add: dict[str, Any] | None = None) -> bytes:
        return wire.forwarded(peeked, WORKFLOW_META_KEY, self.client, add) or body

    def _tools_list(self, peeked: wire.Peeked) -> Edit:
        first_page = not peeked.params.get("cursor")

        async def annotate(message: dict[str, Any]) -> dict[str, Any]:
            page = message.get("result")
            if not isinstance(page, dict):
                return message
            page = self.gateway.tools_page(self.name, page, first_page=first_page)
            self.gateway.annotate(self.name, page)
            return {**message, "result": page}

        return annotate

    async def _lifecycle(self, peeked: wire.Peeked, workflow: str, headers: dict[bytes, bytes], send: Send) -> None:
        arguments = peeked.params.get("arguments")
        try:
            text = await self.gateway.signal(workflow, str(peeked.params["name"]), arguments or {})
        except MCPError as exc:
            await _answer(send, 200, wire.error_response(peeked.id, exc.error.code, exc.error.message), _JSON)
            return
        result: dict[str, Any] = {"content": [{"type": "text", "text": text}], "_meta": {WORKFLOW_META_KEY: workflow}}
        if headers.get(b"mcp-protocol-version", b"").decode("latin-1") in MODERN_PROTOCOL_VERSIONS:
            result["resultType"] = "complete"  # a 2026-era client reads it; absent means complete to the others
        await _answer(send, 200, wire.encode({"jsonrpc": "2.0", "id": peeked.id, "result": result}), _JSON)

    async def _forward(
        self,
        method: str,
        headers: dict[bytes, bytes],
        body: bytes,
        send: Send,
        watch: _Watch,
        request_id: int | str | None = None,
        edit: Edit | None = None,
    ) -> None:
        """Send the request upstream and stream its answer back, `edit`ing the response to `request_id`."""
        upstream = [(k, v) for k, v in headers.items() if k in _REQUEST_HEADERS or k.startswith(b"mcp-")]
        try:
            response = await self.http.request(method, self.target, [*upstream, *self.own_headers], body, self.timeout)
        except UpstreamError as exc:
            log.warning("upstream did not answer", server=self.name, method=method, error=repr(exc))
            message = f"upstream {self.name!r} did not answer: {type(exc).__name__}: {exc}"
            if request_id is not None:  # the client's own request fails, as an MCP error it can read
                await _answer(send, 200, wire.error_response(request_id, types.INTERNAL_ERROR, message), _JSON)
            else:
                await _answer(send, 502, wire.encode({"error": message}), _JSON)
            return
        try:
            kind = (response.header(b"content-type") or b"").decode("latin-1")
            if edit is None or response.status != 200 or not kind.startswith(("application/json", "text/event-stream")):
                await _start(send, response.status, _kept(response.headers))
                await _stream(send, self._noticing(response.chunks()), watch)
            elif kind.startswith("application/json"):
                answer = await _edit_json(await response.read(), request_id, edit)
                watch.finished = True
                await _answer(send, 200, answer, _kept(response.headers, length=False))
            else:
                await _start(send, 200, _kept(response.headers, length=False))
                await _stream_edited(send, self._noticing(response.chunks()), request_id, edit, watch)
        finally:
            response.release()

    async def _noticing(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The chunks as they come; a `tools/list_changed` among them drops the cached listing the steps are
        recorded with (the upstream tells only the session it changed, not the gateway's own)."""
        async for chunk in chunks:
            if _LIST_CHANGED in chunk:
                self.gateway.sessions.forget_tools(self.name)
            yield chunk


def _checked_headers(scope: Scope, is_post: bool) -> tuple[bytes | None, ...]:
    """The values the transport security check reads: the first of each header, as Starlette's `get`."""
    found: dict[bytes, bytes] = {}
    for key, value in scope["headers"]:
        if key in _CHECKED and key not in found:
            found[key] = value
    return (b"post" if is_post else None, *(found.get(key) for key in _CHECKED))


class _Watch:
    """Cancels the request's task when the client goes away before its answer is complete, so that the
    upstream request is closed too (and the upstream cancels what it ran for it).

    The watching task starts only once the request has taken `WATCH_AFTER`: most answers come sooner,
    and a task per request (created, run, cancelled) was a tenth of a fast call's cost. A client
    gone before that is noticed then (uvicorn keeps the disconnect for the next `receive`)."""

    def __init__(self, receive: Receive) -> None:
        self.finished = self.gone = False
        self._task = asyncio.current_task()
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(WATCH_AFTER, self._start)

    def _start(self) -> None:
        self._timer = None
        if not self.finished:
            self._watcher = asyncio.ensure_future(self._watch(self._receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.finished and self._task is not None:
            self.gone = True
            self._task.cancel()

    def close(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _kept(raw: Iterable[tuple[bytes, bytes]], *, length: bool = True) -> list[tuple[bytes, bytes]]:
    """The upstream's headers a client needs (type, session, protocol version); not its cookies or server name."""
    kept = []
    for key, value in raw:
        key = key.lower()
        if (key in _RESPONSE_HEADERS or key.startswith(b"mcp-")) and (length or key != b"content-length"):
            kept.append((key, value))
    return kept


async def _start(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await _start(send, status, [*headers, (b"content-length", str(len(body)).encode())])
    await send({"type": "http.response.body", "body": body})


async def _stream(send: Send, chunks: Any, watch: _Watch) -> None:
    async for chunk in chunks:
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    watch.finished = True
    await send({"type": "http.response.body", "body": b""})


async def _edit_json(raw: bytes, request_id: Any, edit: Edit) -> bytes:
    message = wire.response_to(raw, request_id)
    return raw if message is None else wire.encode(await edit(message))


async def _stream_edited(send: Send, chunks: Any, request_id: Any, edit: Edit, watch: _Watch) -> None:
    """The SSE stream with the response to `request_id` edited. Events before it (progress) pass at once;
    from the response on, what comes is held and sent with the end of the stream, which follows the
    response at once: one write to the client instead of two."""
    splitter, held = wire.EventSplitter(), None
    async for chunk in chunks:
        if held is not None:
            held += chunk
            continue
        passed = []
        for event in splitter.feed(chunk):
            if held is not None:
                held += event
                continue
            data = wire.event_data(event)
            message = wire.response_to(data, request_id) if data is not None else None
            if message is None:
                passed.append(event)
            else:
                held = wire.with_data(event, wire.encode(await edit(message)))
        if held is not None:
            held += splitter.rest()
        if passed:
            await send({"type": "http.response.body", "body": b"".join(passed), "more_body": True})
    watch.finished = True
    await send({"type": "http.response.body", "body": (held or b"") + splitter.rest()})
