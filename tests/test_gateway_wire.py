"""How the pass-through reads the traffic (gateway/wire.py): what it acts on, changes, and refuses."""

from __future__ import annotations

import json

import msgspec
import pytest
from mcp_saga.gateway import wire
from mcp_saga.schemas.events import WORKFLOW_META_KEY as KEY
from mcp_types import CLIENT_INFO_META_KEY

US = {"name": "mcp-saga-gateway", "version": "1"}


def body(message: object) -> bytes:
    return json.dumps(message).encode()


def test_only_tools_requests_are_acted_on_and_unreadable_bodies_are_refused() -> None:
    call = wire.peek(body({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "t"}}))
    assert call is not None and (call.id, call.method, call.params) == (7, "tools/call", {"name": "t"})
    note = wire.peek(body({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 7}}))
    assert note is not None and note.id is None
    assert wire.peek(body({"jsonrpc": "2.0", "id": 3, "result": {}})) is None  # a response to the server
    assert wire.peek(body([{"jsonrpc": "2.0", "method": "notifications/initialized"}])) is None
    for bad, code in [
        (b"{not json", wire.PARSE_ERROR),
        (body([{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t"}}]), wire.INVALID_REQUEST),
        (body({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "t"}}), wire.INVALID_REQUEST),
        (body({"jsonrpc": "2.0", "id": True, "method": "tools/list"}), wire.INVALID_REQUEST),
        (body({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": ["t"]}), wire.INVALID_REQUEST),
    ]:
        with pytest.raises(wire.Unreadable) as refused:
            wire.peek(bad)
        assert refused.value.code == code


def test_the_upstream_gets_the_request_without_our_key_and_the_gateway_as_its_client() -> None:
    meta = {KEY: "wf-1", "progressToken": 5, CLIENT_INFO_META_KEY: {"name": "agent", "version": "9"}}
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "t", "_meta": meta}}
    peeked = wire.peek(body(message))
    assert peeked is not None
    sent = msgspec.json.decode(wire.forwarded(peeked, KEY, US) or b"")
    assert sent["params"] == {"name": "t", "_meta": {"progressToken": 5, CLIENT_INFO_META_KEY: US}}
    only_ours = wire.peek(body({**message, "params": {"name": "t", "_meta": {KEY: "wf-1"}}}))
    assert only_ours is not None
    assert msgspec.json.decode(wire.forwarded(only_ours, KEY, US) or b"")["params"] == {"name": "t"}
    hello = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "agent", "version": "9"}}
    initialize = wire.peek(body({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": hello}))
    assert initialize is not None
    assert msgspec.json.decode(wire.forwarded(initialize, KEY, US) or b"")["params"]["clientInfo"] == US
    keyed = msgspec.json.decode(wire.forwarded(only_ours, KEY, US, {"io.example/key": "k1"}) or b"")
    assert keyed["params"] == {"name": "t", "_meta": {"io.example/key": "k1"}}  # a forward key goes upstream
    untouched = wire.peek(body({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "t"}}))
    assert untouched is not None and wire.forwarded(untouched, KEY, US) is None  # sent as the bytes it came as


def test_the_response_is_found_by_its_id_and_type() -> None:
    reply = body({"jsonrpc": "2.0", "id": 1, "result": {"content": []}})
    assert wire.response_to(reply, 1) == {"jsonrpc": "2.0", "id": 1, "result": {"content": []}}
    assert wire.response_to(reply, "1") is None and wire.response_to(reply, 2) is None
    assert wire.response_to(body({"jsonrpc": "2.0", "method": "notifications/progress", "id": 1}), 1) is None
    assert wire.response_to(b"not json", 1) is None
    error = wire.error_response(4, -32602, "no workflow")
    assert msgspec.json.decode(error) == {
        "jsonrpc": "2.0",
        "id": 4,
        "error": {"code": -32602, "message": "no workflow"},
    }


@pytest.mark.parametrize("newline", [b"\r\n", b"\n"])
def test_sse_events_are_cut_whole_wherever_the_chunks_end(newline: bytes) -> None:
    events = [newline.join([b"event: message", b"id: a1", b"data: " + body({"n": n})]) + newline * 2 for n in range(3)]
    stream = b"".join(events) + b"event: mess"
    for cut in range(1, len(stream)):
        splitter = wire.EventSplitter()
        whole = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert whole == events and splitter.rest() == b"event: mess"
    assert wire.event_data(newline.join([b"data: {", b'data: "a": 1}']) + newline * 2) == b'{\n"a": 1}'
    assert wire.event_data(b": ping" + newline * 2) is None
    edited = wire.with_data(events[0], b'{"n": 9}')
    assert edited == b'event: message\r\nid: a1\r\ndata: {"n": 9}\r\n\r\n'
    assert wire.EventSplitter().feed(edited) == [edited]
