"""The pass-through's HTTP/1.1 client (gateway/upstream.py) against real sockets: a local asyncio server that
answers as servers do (Content-Length, chunked, read to close) or misbehaves (closes mid-answer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import cast

import pytest
from mcp_saga.runtime.http_client import Target, UpstreamError, Upstreams

pytestmark = pytest.mark.anyio
Answer = Callable[[bytes], list[bytes]]


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """asyncio's own loop, and uvloop's (`[gateway] loop = "uvloop"`), whose transports are no asyncio.Transport."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    return "asyncio", {"use_uvloop": request.param == "uvloop"}


class _Server(asyncio.Protocol):
    """Answers each whole request (headers and Content-Length body) with `answer(request)`, piece by piece."""

    def __init__(self, answer: Answer, seen: list[bytes], connections: list[int]) -> None:
        self.answer, self.seen, self.buffer = answer, seen, b""
        connections.append(1)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ),
                0,
            )
            if len(rest) < length:
                return
            request, self.buffer = head + b"\r\n\r\n" + rest[:length], rest[length:]
            self.seen.append(request)
            for piece in self.answer(request):
                if piece == b"<close>":
                    self.transport.close()
                    return
                self.transport.write(piece)


@contextlib.asynccontextmanager
async def _serve(answer: Answer) -> AsyncIterator[tuple[Target, list[bytes], list[int]]]:
    seen: list[bytes] = []
    connections: list[int] = []
    server = await asyncio.get_running_loop().create_server(lambda: _Server(answer, seen, connections), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Target.of(f"http://127.0.0.1:{port}/mcp?x=1"), seen, connections
    finally:
        server.close()


def _json(request: bytes) -> list[bytes]:
    body = b'{"ok": true}'
    return [b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body), body]


async def test_one_write_per_request_and_the_connection_is_reused() -> None:
    async with _serve(_json) as (target, seen, connections):
        async with Upstreams() as upstreams:
            for n in range(3):
                body = b'{"n": %d}' % n
                response = await upstreams.request("POST", target, [(b"mcp-session-id", b"s1")], body, 5)
                assert (response.status, response.header(b"content-type")) == (200, b"application/json")
                assert await response.read() == b'{"ok": true}'
                response.release()
        assert len(connections) == 1  # kept alive across the three
        head, _, body = seen[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /mcp?x=1 HTTP/1.1" and body == b'{"n": 0}'
        assert {b"mcp-session-id: s1", b"content-length: 8", b"accept-encoding: identity"} <= set(lines)


async def test_chunked_and_read_to_close_answers_stream_as_they_come() -> None:
    def answer(request: bytes) -> list[bytes]:
        if request.startswith(b"GET"):
            return [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", b"data: 1\n\n", b"<close>"]
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head, b"9\r\ndata: 1\n\n\r\n", b"9\r\ndata: 2\n\n\r\n", b"0\r\n\r\n"]

    async with _serve(answer) as (target, _, connections):
        async with Upstreams() as upstreams:
            response = await upstreams.request("POST", target, [], b"{}", 5)
            assert [chunk async for chunk in response.chunks()] in (
                [b"data: 1\n\n", b"data: 2\n\n"],
                [b"data: 1\n\ndata: 2\n\n"],
            )
            response.release()
            stream = await upstreams.request("GET", target, [], b"", 5)
            assert await stream.read() == b"data: 1\n\n"  # no length: the answer ends with the connection
            stream.release()
            again = await upstreams.request("POST", target, [], b"{}", 5)
            await again.read()
            again.release()
        assert len(connections) == 2  # the chunked answer's connection served the third request


async def test_a_broken_answer_is_an_error_and_its_connection_is_not_reused() -> None:
    def answer(request: bytes) -> list[bytes]:
        if b"truncate" in request:
            return [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b"only part", b"<close>"]
        return _json(request)

    async with _serve(answer) as (target, _, connections):
        async with Upstreams() as upstreams:
            response = await upstreams.request("POST", target, [], b'"truncate"', 5)
            with pytest.raises(UpstreamError, match="before its answer ended"):
                await response.read()
            response.release()
            fine = await upstreams.request("POST", target, [], b"{}", 5)
            assert await fine.read() == b'{"ok": true}'
            fine.release()
        assert len(connections) == 2
    with pytest.raises(UpstreamError, match="could not connect"):
        async with Upstreams() as upstreams:
            await upstreams.request("POST", Target.of("http://127.0.0.1:9/mcp"), [], b"{}", 2)
