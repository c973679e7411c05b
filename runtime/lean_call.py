"""The worker's `tools/call` over streamable HTTP as one POST on the lean HTTP/1.1 client.

A compensation is CPU-bound in the worker, and most of its CPU was the MCP SDK's client: about
2.8 ms of 5-6.5 ms per call, mostly httpx2 (~920 µs a POST) and the anyio streams between the
session, its dispatcher and the transport. The SDK's `Client` still connects, negotiates and
lists tools (and serves stdio and anything unusual); once it is connected, this sends the call
itself, built and stamped by that live session (protocol version, `_meta` envelope,
`Mcp-Method`/`Mcp-Name`/`Mcp-Param-*` headers, the session id it was given) and reads the
answer as the SDK's streamable HTTP transport does. Errors come out as the SDK's `MCPError`s
with the SDK's codes and messages, so the session owner classifies them as before.

What it does not do, and where it steps aside: a server that asks the client something in the
middle of a call (a server->client request on the SSE stream) is answered as the SDK answers
with no handler, and from then on the SDK serves that server; so does a server whose SSE events
carry ids (it can resume a broken stream, which the SDK's transport follows and this does not)
and one that answers with a redirect (the call was not run: the SDK sends it, and follows the
redirect where it would). These choices are made before a call is sent or on an answer that
says the call did not run: a call that may have run is never sent again.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import anyio
import mcp_types as types
import msgspec
from mcp import Client, MCPError
from mcp.client import session as sdk_session
from mcp.shared.inbound import MCP_NAME_HEADER, encode_header_value
from mcp_saga.runtime.http_client import BlockingConnection, Target, Upstreams
from mcp_types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

# The SDK's own limit on one SSE event (mcp/client/streamable_http.py DEFAULT_MAX_SSE_EVENT_SIZE).
MAX_SSE_EVENT = 1024 * 1024
SESSION_ID = "mcp-session-id"
# The fallback the SDK uses before a version was negotiated (ClientSession.send_request).
DEFAULT_VERSION = "2025-11-25"
# What the SDK answers, with no callback of its own, to a server->client request (its _default_* callbacks).
_UNHANDLED = {
    "sampling/createMessage": "Sampling not supported",
    "elicitation/create": "Elicitation not supported",
    "roots/list": "List roots not supported",
}
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class NotLean(Exception):
    """The SDK must make this call: raised only before the call was sent or when the answer says it did not run."""


class LeanChannel:
    """One connected session's direct line to its server; made per connection by the session owner."""

    def __init__(self, url: str, headers: dict[str, str], connect_timeout: float) -> None:
        self.target = Target.of(url)
        self.url = url
        # The ServerConfig's headers are the SDK's httpx client defaults: the SDK's own win over them.
        self.defaults = {name.lower(): value for name, value in headers.items()}
        self.connect_timeout = connect_timeout
        self.session_id: str | None = None
        self.initialized = False
        self.usable = True
        self.sent = 0  # calls this channel sent (the tests and the benchmark tell the two paths apart by it)
        self.direct = 0  # of which the calling thread sent itself (`send_blocking`)
        self.upstreams = Upstreams()
        # Apart from the SDK's ids (counted from 0 on the same session), so a stateful server never sees one twice.
        self._ids = itertools.count(1 << 40)

    async def saw_response(self, response: Any) -> None:
        """An httpx2 response hook on the SDK's client: the session id the server gave (the SDK keeps the one
        its initialize answer carried), and whether the SDK's `notifications/initialized` has gone through."""
        session_id = response.headers.get(SESSION_ID)
        if session_id:
            self.session_id = session_id
        if not self.initialized and b'"notifications/initialized"' in response.request.content:
            self.initialized = True

    def ready(self, session: Any) -> bool:
        """Whether a call may go out here now: the SDK sends nothing before `notifications/initialized` has been
        answered (one POST after another), so neither does this; a 2026-07-28 session has no such notification."""
        return self.usable and (self.initialized or session.protocol_version in MODERN_PROTOCOL_VERSIONS)

    async def call_tool(
        self, client: Client, name: str, arguments: dict[str, Any], meta: dict[str, Any] | None, timeout: float
    ) -> types.CallToolResult:
        """What `client.call_tool(name, arguments, meta=meta)` returns, with the same errors."""
        session = client.session
        try:
            return await self._call(client, name, arguments, meta)
        except MCPError as mismatch:
            if mismatch.code != HEADER_MISMATCH or session.protocol_version not in MODERN_PROTOCOL_VERSIONS:
                raise
            # As the SDK's Client: the server refused the call unrun over a stale listing; re-list, send once more.
            try:
                with anyio.fail_after(timeout):
                    await client._relist_tool(name)
            except (MCPError, TimeoutError, ValueError) as relist_error:
                raise mismatch from relist_error
            return await self._call(client, name, arguments, meta)

    async def _call(
        self,
        client: Client,
        name: str,
        arguments: dict[str, Any],
        meta: dict[str, Any] | None,
    ) -> types.CallToolResult:
        raw = await self.send(client.session, name, arguments, meta)
        return await self.settle(client, name, arguments, meta, self.result_of(client.session, name, raw))

    def result_of(self, session: Any, name: str, raw: dict[str, Any]) -> Any:
        """The answer's `result` read as the session's SDK reads it for its era (not yet checked against the tool)."""
        sdk_session._clamp_inbound_ttl(raw)
        version = session.protocol_version or DEFAULT_VERSION
        with contextlib.suppress(KeyError):  # a method the version does not list: as the SDK, no check
            types.methods.validate_server_result("tools/call", version, raw)
        if not (foreign := sdk_session._later_revision_fields("tools/call", version)).isdisjoint(raw):
            raw = {key: value for key, value in raw.items() if key not in foreign}
        return session._call_tool_adapter.validate_python(raw, by_name=False)

    def settles_at_once(self, session: Any, name: str, result: Any) -> bool:
        """Whether `settle` will finish without waiting on the session: an error result or one whose tool's output
        schema the session has cached; anything else (a listing to fetch, input to ask for) needs the session's loop."""
        return isinstance(result, types.CallToolResult) and (result.is_error or name in session._tool_output_schemas)

    async def settle(
        self, client: Client, name: str, arguments: dict[str, Any], meta: dict[str, Any] | None, result: Any
    ) -> types.CallToolResult:
        """What the SDK's `call_tool` does with a result: the tool's output schema, input-required rounds."""
        session = client.session
        if isinstance(result, types.CallToolResult) and not result.is_error:
            await session.validate_tool_result(name, result)
        if isinstance(result, types.InputRequiredResult):

            async def again(responses: types.InputResponses | None, state: str | None) -> Any:
                return await session.call_tool(
                    name,
                    arguments,
                    input_responses=responses,
                    request_state=state,
                    meta=meta,
                    allow_input_required=True,
                    allow_claimed=True,
                )

            result = await client._drive_input_required(result, again)
        if not isinstance(result, types.CallToolResult):
            raise RuntimeError(f"tool {name} returned a result this client does not claim: {type(result).__name__}")
        return result

    def request(
        self, session: Any, name: str, arguments: dict[str, Any], meta: dict[str, Any] | None
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """The POST's body and headers as the SDK would build them, stamped by the live session."""
        request = types.CallToolRequest(params=types.CallToolRequestParams(name=name, arguments=arguments, _meta=meta))
        data = request.model_dump(by_alias=True, mode="json", exclude_none=True)
        opts: dict[str, Any] = {}
        session._stamp(data, opts)  # the live session's stamp: its era's `_meta` envelope and headers
        stamped: dict[str, str] = opts.get("headers") or {}
        if (key := type(request).name_param) is not None and MCP_NAME_HEADER not in stamped:
            stamped[MCP_NAME_HEADER] = encode_header_value(data["params"][key])
        params = data.get("params") or {}
        if not params.get("_meta"):
            params.pop("_meta", None)
        request_id = next(self._ids)
        self.sent += 1
        body = _encode.encode({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})
        return body, self._headers(stamped)

    async def send(
        self, session: Any, name: str, arguments: dict[str, Any], meta: dict[str, Any] | None
    ) -> dict[str, Any]:
        """POST the request as the SDK would build it; the `result` of its answer, or the SDK's MCPError."""
        body, headers = self.request(session, name, arguments, meta)
        response = await self.upstreams.request("POST", self.target, headers, body, self.connect_timeout)
        try:
            verdict = self._verdict(response.status, response.header(b"content-type"))
            if verdict != "sse":
                return self._settled(verdict, response.status, await response.read() if verdict != "error" else b"")
            events = SseEvents()
            async for chunk in response.chunks():
                for event in events.feed(chunk):
                    outcome = self._event(*event)
                    if isinstance(outcome, bytes):
                        await self._refuse(outcome)
                    elif outcome is not None:
                        return outcome
            raise _stream_ended()
        finally:
            response.release()  # a connection whose answer did not end (a cancelled call) is closed

    def send_blocking(
        self,
        connection: BlockingConnection,
        session: Any,
        name: str,
        arguments: dict[str, Any],
        meta: dict[str, Any] | None,
        deadline: float,
    ) -> dict[str, Any]:
        """`send` from the calling thread on its own connection; TimeoutError once `deadline` (monotonic) passed."""
        body, headers = self.request(session, name, arguments, meta)
        self.direct += 1
        response = connection.request("POST", headers, body, deadline)
        try:
            verdict = self._verdict(response.status, response.header(b"content-type"))
            if verdict != "sse":
                return self._settled(verdict, response.status, response.read() if verdict != "error" else b"")
            events = SseEvents()
            for chunk in response.chunks():
                for event in events.feed(chunk):
                    outcome = self._event(*event)
                    if isinstance(outcome, bytes):
                        self._refuse_blocking(outcome, deadline)
                    elif outcome is not None:
                        return outcome
            raise _stream_ended()
        finally:
            response.release()

    def _headers(self, stamped: dict[str, str]) -> list[tuple[bytes, bytes]]:
        headers = {**self.defaults, "accept": "application/json, text/event-stream", "content-type": "application/json"}
        if self.session_id:
            headers[SESSION_ID] = self.session_id
        headers.update((name.lower(), value) for name, value in stamped.items())
        return [(name.encode(), value.encode()) for name, value in headers.items()]

    def _verdict(self, status: int, content_type_header: bytes | None) -> str:
        """How to read an answer, from its head: "json", "sse", "error-json" (an error with a JSON body) or "error";
        the SDK's error for an answer it refuses outright."""
        content_type = (content_type_header or b"").decode("latin-1").lower()
        if status == 202:
            raise MCPError(INVALID_REQUEST, "server answered a request with 202 Accepted")
        if 300 <= status < 400:
            self.usable = False
            raise NotLean(f"the server answered {status} (a redirect): the SDK follows those it may")
        if status >= 400:
            return "error-json" if content_type.startswith("application/json") else "error"
        if content_type.startswith("application/json"):
            return "json"
        if content_type.startswith("text/event-stream"):
            return "sse"
        raise MCPError(INVALID_REQUEST, f"Unexpected content type: {content_type}")

    def _settled(self, verdict: str, status: int, content: bytes) -> dict[str, Any]:
        """The `result` of a whole JSON answer, or the SDK's error for it or for an error status."""
        if verdict == "json":
            try:
                message = _decode.decode(content)
            except msgspec.DecodeError as exc:
                raise MCPError(PARSE_ERROR, f"Failed to parse JSON response: {exc}") from None
            return _outcome(message, PARSE_ERROR, "Failed to parse JSON response")
        if verdict == "error-json":
            try:
                message = _decode.decode(content)
            except msgspec.DecodeError:
                message = None
            if isinstance(message, dict) and isinstance(error := message.get("error"), dict):
                raise _error(error)
        if status == 404:
            if self.session_id is None:
                raise MCPError(METHOD_NOT_FOUND, "Not Found")
            raise MCPError(INVALID_REQUEST, "Session terminated")
        raise MCPError(INTERNAL_ERROR, "Server returned an error response")

    def _event(self, event: str, data: str, event_id: str | None) -> dict[str, Any] | bytes | None:
        """One SSE event of the answer: the call's `result` (or its error raised), the body of an answer to post to a
        question the server asks mid-call, or None for anything else."""
        if event_id:
            self.usable = False  # a resumable stream: later calls go through the SDK, which resumes them
        if event != "message" or not data:
            return None
        try:
            message = _decode.decode(data)
        except msgspec.DecodeError as exc:
            raise MCPError(PARSE_ERROR, f"Failed to parse SSE message: {exc}") from None
        if isinstance(message, dict) and "method" in message:
            if "id" in message:  # the server asks us something mid-call
                self.usable = False
                return _encode.encode(_refusal(message))
            return None  # notifications (progress, logs): the worker has no handler for them
        return _outcome(message, PARSE_ERROR, "Failed to parse SSE message")

    async def _refuse(self, answer: bytes) -> None:
        response = await self.upstreams.request("POST", self.target, self._headers({}), answer, self.connect_timeout)
        try:
            await response.read()
        finally:
            response.release()

    def _refuse_blocking(self, answer: bytes, deadline: float) -> None:
        """`_refuse` on a connection of its own: the call's is still carrying the call's answer."""
        connection = BlockingConnection(self.target, self.connect_timeout)
        try:
            connection.request("POST", self._headers({}), answer, deadline).read()
        finally:
            connection.close()


def _refusal(request: dict[str, Any]) -> dict[str, Any]:
    """The answer the SDK gives a server->client request when it has no callback for it."""
    method = request.get("method")
    if method == "ping":
        return {"jsonrpc": "2.0", "id": request["id"], "result": {}}
    error = (
        {"code": INVALID_REQUEST, "message": _UNHANDLED[method]}
        if method in _UNHANDLED
        else {"code": METHOD_NOT_FOUND, "message": "Method not found", "data": method}
    )
    return {"jsonrpc": "2.0", "id": request["id"], "error": error}


def _stream_ended() -> MCPError:
    return MCPError(CONNECTION_CLOSED, "SSE stream ended without a response")


def _error(error: dict[str, Any]) -> MCPError:
    code, message = error.get("code"), error.get("message")
    if not isinstance(code, int) or not isinstance(message, str):
        return MCPError(PARSE_ERROR, f"Failed to parse the error answer: {error!r:.200}")
    return MCPError(code, message, error.get("data"))


def _outcome(message: Any, code: int, what: str) -> dict[str, Any]:
    """The `result` of a JSON-RPC answer, or its error as the SDK raises it."""
    if isinstance(message, dict):
        if isinstance(error := message.get("error"), dict):
            raise _error(error)
        if isinstance(result := message.get("result"), dict):
            return result
    raise MCPError(code, f"{what}: not a JSON-RPC answer: {message!r:.200}")


class SseEvents:
    """(event, data, id) per SSE event, fed the stream as it comes (WHATWG's parsing: field lines, data lines
    joined, a blank line ends one)."""

    def __init__(self) -> None:
        self.pending = b""
        self._next()

    def _next(self) -> None:
        self.event, self.event_id, self.size = "", None, 0
        self.data: list[str] = []

    def feed(self, chunk: bytes) -> Iterator[tuple[str, str, str | None]]:
        text, carry = self.pending + chunk, b""
        if text.endswith(b"\r"):  # maybe half of a CRLF: decide with the next chunk
            text, carry = text[:-1], b"\r"
        *lines, pending = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self.pending = pending + carry
        for line in lines:
            if not line:
                if self.data or self.event_id:
                    yield self.event or "message", "\n".join(self.data), self.event_id
                self._next()
                continue
            field, _, value = line.partition(b":")
            if value.startswith(b" "):
                value = value[1:]
            if field == b"data":
                self.size += len(value)
                if self.size > MAX_SSE_EVENT:
                    raise MCPError(CONNECTION_CLOSED, f"SSE stream failed: an event over {MAX_SSE_EVENT} bytes")
                self.data.append(value.decode())
            elif field == b"event":
                self.event = value.decode()
            elif field == b"id":
                self.event_id = value.decode() or None
