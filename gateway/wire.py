"""Peeking into the streamable HTTP traffic the gateway passes through: pure functions over bytes.

The pass-through reads only what it must act on: whether a POST carries a `tools/call` or a
`tools/list` request (and its id), and, in the upstream's answer (one JSON body or an SSE
stream), the JSON-RPC response with that id. Everything else goes on as the bytes it came as.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from mcp_types import CLIENT_INFO_META_KEY

PEEKED = frozenset({"tools/call", "tools/list"})
PARSE_ERROR, INVALID_REQUEST = -32700, -32600
_decode = msgspec.json.Decoder().decode
encode = msgspec.json.Encoder().encode
# An SSE event ends at a blank line, whichever of the three line endings the server uses.
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class Unreadable(ValueError):
    """A POST body the gateway will not forward: it could not tell whether it holds a call to record."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Peeked:
    """One JSON-RPC request or notification from the client: its id (None for a notification), method, params."""

    id: int | str | None
    method: str
    params: dict[str, Any]
    message: dict[str, Any]


def peek(body: bytes) -> Peeked | None:
    """The message in a POST body, or None for what is only forwarded (a batch without tools calls, a response).

    A body that is not JSON, or a batch holding a tools call, is `Unreadable`: forwarding what the
    gateway cannot read would let a call through unrecorded if the upstream's parser is kinder.
    """
    try:
        message = _decode(body)
    except msgspec.DecodeError as exc:
        raise Unreadable(PARSE_ERROR, f"the request body is not JSON: {exc}") from None
    if isinstance(message, list):
        if any(isinstance(item, dict) and item.get("method") in PEEKED for item in message):
            raise Unreadable(INVALID_REQUEST, "send tools/call and tools/list one per request, not in a batch")
        return None
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        return None
    method, request_id, params = message["method"], message.get("id"), message.get("params")
    if method in PEEKED and (isinstance(request_id, bool) or not isinstance(request_id, int | str)):
        raise Unreadable(INVALID_REQUEST, f"a {method} request needs an id")
    if not isinstance(params, dict | None):
        raise Unreadable(INVALID_REQUEST, f"the params of {method} must be an object")
    return Peeked(request_id, method, params or {}, message)


def forwarded(peeked: Peeked, drop: str, client: dict[str, Any], add: dict[str, Any] | None = None) -> bytes | None:
    """The message as the upstream gets it, re-encoded only when it changes (else None: send the bytes
    as they came): without our `_meta[drop]`, with `add` in its `_meta` (a call's forward key), and
    introducing the sender as `client` (the gateway) wherever MCP says who the client is, in
    `initialize` and in the 2026 per-request `_meta`."""
    params = peeked.params
    meta = params.get("_meta")
    meta = meta if isinstance(meta, dict) else None
    has_meta = meta is not None and (drop in meta or CLIENT_INFO_META_KEY in meta)
    introduces = peeked.method == "initialize" and "clientInfo" in params
    if not (has_meta or introduces or add):
        return None
    params = dict(params)
    if introduces:
        params["clientInfo"] = client
    if has_meta or add:
        kept = {k: v for k, v in (meta or {}).items() if k != drop}
        if CLIENT_INFO_META_KEY in kept:
            kept[CLIENT_INFO_META_KEY] = client
        kept.update(add or {})
        params.pop("_meta", None)
        if kept:
            params["_meta"] = kept
    return encode({**peeked.message, "params": params})


def response_to(data: bytes, request_id: int | str) -> dict[str, Any] | None:
    """The JSON-RPC response with `request_id` in one message's bytes, else None (notifications, requests)."""
    try:
        message = _decode(data)
    except msgspec.DecodeError:
        return None
    if (
        isinstance(message, dict)
        and "method" not in message
        and ("result" in message or "error" in message)
        and message.get("id") == request_id
        and type(message.get("id")) is type(request_id)
    ):
        return message
    return None


def error_response(request_id: int | str | None, code: int, message: str) -> bytes:
    return encode({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


class EventSplitter:
    """Cuts an SSE byte stream into whole events, each with its terminating blank line."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events = []
        while (end := _EVENT_END.search(self._buffer)) is not None:
            events.append(self._buffer[: end.end()])
            self._buffer = self._buffer[end.end() :]
        return events

    def rest(self) -> bytes:
        """What has come since the last whole event; the splitter is empty afterwards."""
        rest, self._buffer = self._buffer, b""
        return rest


def event_data(event: bytes) -> bytes | None:
    """An event's data (its `data:` lines joined), or None for an event without data (a comment, a retry)."""
    data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def with_data(event: bytes, data: bytes) -> bytes:
    """The event with its data replaced, its other fields (`event:`, `id:`) kept as they were."""
    kept = [line for line in event.splitlines() if line and not line.startswith(b"data:")]
    return b"\r\n".join([*kept, b"data: " + data]) + b"\r\n\r\n"
