"""The blocking HTTP/1.1 connection a worker's job thread calls its server on (runtime/http_client.py
BlockingConnection), against the same local server as the asyncio client's tests, run on a loop in a thread:
answers with Content-Length, chunked or read to close, and servers that misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from mcp_saga.runtime.http_client import BlockingConnection, Target, UpstreamError, request_head
from test_http_client import Answer, _json, _Server


@contextlib.contextmanager
def _serve(answer: Answer) -> Iterator[tuple[Target, list[bytes], list[int]]]:
    seen: list[bytes] = []
    connections: list[int] = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made = loop.create_server(lambda: _Server(answer, seen, connections), "127.0.0.1", 0)
    server = asyncio.run_coroutine_threadsafe(made, loop).result(5)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Target.of(f"http://127.0.0.1:{port}/mcp?x=1"), seen, connections
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def test_the_same_request_bytes_and_the_connection_is_reused() -> None:
    with _serve(_json) as (target, seen, connections):
        connection = BlockingConnection(target, 5)
        for n in range(3):
            body = b'{"n": %d}' % n
            response = connection.request("POST", [(b"mcp-session-id", b"s1")], body, _soon())
            assert (response.status, response.header(b"content-type")) == (200, b"application/json")
            assert response.read() == b'{"ok": true}'
            response.release()
        connection.close()
        assert len(connections) == 1  # kept alive across the three
        assert seen[0] == request_head("POST", target, [(b"mcp-session-id", b"s1")], b'{"n": 0}') + b'{"n": 0}'


def test_chunked_and_read_to_close_answers_stream_as_they_come() -> None:
    def answer(request: bytes) -> list[bytes]:
        if request.startswith(b"GET"):
            return [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", b"data: 1\n\n", b"<close>"]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head, b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]

    with _serve(answer) as (target, _, connections):
        connection = BlockingConnection(target, 5)
        response = connection.request("POST", [], b"{}", _soon())
        assert b"".join(response.chunks()) == b"data: 1\n\ndata: 2\n\n"
        response.release()
        stream = connection.request("GET", [], b"", _soon())  # on the same connection
        assert stream.read() == b"data: 1\n\n"  # no length: the answer ends with the connection
        stream.release()
        again = connection.request("POST", [], b"{}", _soon())
        again.read()
        again.release()
        connection.close()
        assert len(connections) == 2  # the read-to-close answer took its connection with it


def test_an_answer_broken_mid_way_is_an_error_and_its_connection_is_not_reused() -> None:
    def answer(request: bytes) -> list[bytes]:
        if b"truncate" in request:
            return [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b"only part", b"<close>"]
        if b"garble" in request:
            return [b"SMTP ready\r\n\r\n"]
        return _json(request)

    with _serve(answer) as (target, _, connections):
        connection = BlockingConnection(target, 5)
        response = connection.request("POST", [], b'"truncate"', _soon())
        with pytest.raises(UpstreamError, match="before its answer ended"):
            response.read()
        response.release()
        fine = connection.request("POST", [], b"{}", _soon())
        assert fine.read() == b'{"ok": true}'
        fine.release()
        assert len(connections) == 2
        with pytest.raises(UpstreamError, match="not an HTTP answer"):
            garbled = connection.request("POST", [], b'"garble"', _soon())
            garbled.read()
            garbled.release()
        connection.close()
    with pytest.raises(UpstreamError, match="could not connect"):
        BlockingConnection(Target.of("http://127.0.0.1:9/mcp"), 2).request("POST", [], b"{}", _soon())


def test_no_answer_by_the_deadline_is_a_timeout_and_closes_the_connection() -> None:
    def answer(request: bytes) -> list[bytes]:
        if b"never" in request:
            return []
        if b"half" in request:
            return [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b"only part"]
        return _json(request)

    with _serve(answer) as (target, _, connections):
        connection = BlockingConnection(target, 5)
        with pytest.raises(TimeoutError):
            connection.request("POST", [], b'"never"', _soon(0.3))
        assert connection.sock is None
        response = connection.request("POST", [], b'"half"', _soon(0.3))
        with pytest.raises(TimeoutError):
            response.read()
        response.release()
        assert connection.sock is None
        fine = connection.request("POST", [], b"{}", _soon())
        assert fine.read() == b'{"ok": true}'
        fine.release()
        connection.close()
        assert len(connections) == 3


def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    """A server may close a kept-alive connection between two requests (its keep-alive ran out); the asyncio
    client learns of it from the loop, the blocking one looks before it sends."""

    def answer(request: bytes) -> list[bytes]:
        return [*_json(request), b"<close>"]  # says keep-alive (HTTP/1.1), then closes anyway

    with _serve(answer) as (target, seen, connections):
        connection = BlockingConnection(target, 5)
        for _ in range(2):
            response = connection.request("POST", [], b"{}", _soon())
            assert response.read() == b'{"ok": true}'
            response.release()
            deadline = _soon()
            while len(seen) < 1 or (connection.sock is not None and not _closed_by_peer(connection)):
                assert time.monotonic() < deadline, "the server did not close"
                time.sleep(0.01)
        connection.close()
        assert len(connections) == 2 and len(seen) == 2


def _closed_by_peer(connection: BlockingConnection) -> bool:
    import select

    assert connection.sock is not None
    return bool(select.select([connection.sock], [], [], 0)[0])
