"""A lean HTTP/1.1 client: keep-alive connections to the registry's URLs, one write per request.

At a 2 ms tool the gateway's whole budget is a few hundred microseconds a call (and a worker's
compensation is CPU-bound), and the general clients spend it on their own: measured here (2000
sequential POSTs on one keep-alive connection, CPU per request) httpx2 about 920 µs, aiohttp about
200 µs, this client about 45 µs (httptools' C parser, the one uvicorn uses, on an asyncio
protocol). It does only what MCP over streamable HTTP needs: a request with a whole body, an
answer with Content-Length, chunked or read to close, streamed as it comes; no redirects,
proxies, cookies or compression (it asks for identity). `BlockingConnection` is the same exchange
for a thread that is on no event loop (the worker's job thread).
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

# Idle connections are reused for a little less than uvicorn's 5 s keep-alive, so the gateway does not
# pick one the upstream is closing; a paused reader resumes once the consumer has taken this much.
KEEPALIVE = 4.0
HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """No complete answer: the connection could not be made, or broke before the answer ended."""


@dataclass(frozen=True, slots=True)
class Target:
    """A registry URL, parsed once: where to connect and what to put in the request line and Host."""

    host: str
    port: int
    tls: bool
    path: bytes
    authority: bytes

    @classmethod
    def of(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, port, tls, path.encode(), parts.netloc.rsplit("@", 1)[-1].encode())


def request_head(method: str, target: Target, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The request line and headers, for the asyncio and the blocking connection alike."""
    return b"".join(
        [
            method.encode(),
            b" ",
            target.path,
            b" HTTP/1.1\r\nhost: ",
            target.authority,
            b"\r\naccept-encoding: identity\r\n",
            *[b"%s: %s\r\n" % (name, value) for name, value in headers],
            b"content-length: %d\r\n\r\n" % len(body) if body or method == "POST" else b"\r\n",
        ]
    )


def _framed(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether an answer says where it ends; one that does not is read to the close, and ends with it."""
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)


def _closed_early(exc: object) -> UpstreamError:
    return UpstreamError(f"the upstream closed the connection before its answer ended ({exc or 'EOF'})")


def _garbled(exc: Exception) -> UpstreamError:
    return UpstreamError(f"the upstream sent what is not an HTTP answer: {exc}")


class _Connection(asyncio.Protocol):
    """One connection; it carries one exchange at a time, and its parser state is that exchange's."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0

    # The exchange: set up by `start`, filled by the parser's callbacks.
    def start(self, head: bytes, body: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.keep_alive = self.complete = False
        self.error: UpstreamError | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.got_headers: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiter: asyncio.Future[None] | None = None
        self.transport.write(head + body)
        return self.got_headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's TCPTransport has the methods of asyncio.Transport but is
        # no subclass of it; the assertion failed inside uvloop's callback and left the connection
        # without its transport (the call through the gateway then failed or hung).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (AttributeError, httptools.HttpParserError) as exc:  # bytes with no request out, or garbled
            self._fail(_garbled(exc))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if getattr(self, "got_headers", None) is None or self.complete:
            return
        if self.got_headers.done() and not _framed(self.headers):
            self.on_message_complete()  # an answer without a length is read to the close, and ends with it
        else:
            self._fail(_closed_early(exc))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser forgets it once the answer ends
        if not self.got_headers.done():
            self.got_headers.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()  # a slow client: let TCP push back on the upstream
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self.error = error
        if not self.got_headers.done():
            self.got_headers.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next_chunks(self) -> list[bytes]:
        """What has come of the body since the last call; [] once the answer has ended."""
        while not self.chunks and not self.complete:
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        taken, self.chunks, self.buffered = self.chunks, [], 0
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        return taken

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An upstream's answer: status and headers at once, the body as it comes; `release` when done."""

    def __init__(self, connection: _Connection, pool: Upstreams, target: Target) -> None:
        self._connection, self._pool, self._target = connection, pool, target
        self.status = connection.status
        self.headers = connection.headers  # names lower-cased

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    async def chunks(self) -> AsyncIterator[bytes]:
        while taken := await self._connection.next_chunks():
            for chunk in taken:
                yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """A connection whose answer ended cleanly goes back to the pool; any other is closed (which tells
        the upstream the client went away)."""
        connection = self._connection
        if connection.complete and connection.error is None and not connection.closed and connection.keep_alive:
            connection.idle_since = time.monotonic()
            self._pool.idle.setdefault(self._target, []).append(connection)
        else:
            connection.close()


class Upstreams:
    """Pooled connections per target, shared by every endpoint; use inside `async with`."""

    def __init__(self) -> None:
        self.idle: dict[Target, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def __aenter__(self) -> Upstreams:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for connections in self.idle.values():
            for connection in connections:
                connection.close()
        self.idle.clear()

    async def request(
        self, method: str, target: Target, headers: list[tuple[bytes, bytes]], body: bytes, connect_timeout: float
    ) -> Response:
        """Send one request and wait for the answer's headers (as long as the upstream takes: the client has
        its own timeout, and cancels by going away); only connecting is bounded."""
        head = request_head(method, target, headers, body)
        connection = self._idle(target) or await self._connect(target, connect_timeout)
        try:
            await connection.start(head, body)
        except BaseException:
            connection.close()
            raise
        return Response(connection, self, target)

    def _idle(self, target: Target) -> _Connection | None:
        connections, now = self.idle.get(target), time.monotonic()
        while connections:
            connection = connections.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE:
                return connection
            connection.close()
        return None

    async def _connect(self, target: Target, timeout: float) -> _Connection:
        tls = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, target.host, target.port, ssl=tls), timeout
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(
                f"could not connect to {target.host}:{target.port}: {exc or type(exc).__name__}"
            ) from exc
        return connection


# How long one blocking read waits at most, so that an exception raised in the reading thread from
# outside (RQ's job timeout in a slot thread, PyThreadState_SetAsyncExc) lands within a second.
READ_SLICE = 1.0


class BlockingConnection:
    """One keep-alive connection owned by one thread, which sends and reads on it itself.

    The worker's job thread makes its call on this instead of handing it to the session loop's thread
    and waiting for the answer to come back: each of those hand-overs cost 0.2-0.5 ms on a busy
    worker. One exchange at a time, as on `_Connection`; the same request bytes and the same parser.
    """

    def __init__(self, target: Target, connect_timeout: float) -> None:
        self.target = target
        self.connect_timeout = connect_timeout
        self.sock: socket.socket | None = None
        self.idle_since = 0.0
        self.deadline = 0.0

    def request(
        self, method: str, headers: list[tuple[bytes, bytes]], body: bytes, deadline: float
    ) -> BlockingResponse:
        """Send one request and wait for the answer's headers; TimeoutError once `deadline` (monotonic) passed."""
        head = request_head(method, self.target, headers, body)
        if not self._reusable():
            self.close()
            self._connect(deadline)
        assert self.sock is not None
        self.deadline = deadline
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.got_headers = self.keep_alive = self.complete = False
        self.chunks: list[bytes] = []
        try:
            try:
                self.sock.sendall(head + body)
            except OSError as exc:
                raise _closed_early(exc) from exc
            while not self.got_headers:
                self.receive()
        except BaseException:
            self.close()
            raise
        return BlockingResponse(self)

    def receive(self) -> None:
        """Feed the parser what the upstream sends next (or learn that it closed)."""
        assert self.sock is not None
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer before the deadline")
        self.sock.settimeout(min(remaining, READ_SLICE))
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return
        except OSError as exc:
            raise _closed_early(exc) from exc
        if not data:
            self.sock.close()
            self.sock = None
            if not (self.got_headers and not _framed(self.headers)):
                raise _closed_early(None)
            self.complete = True  # an answer without a length is read to the close, and ends with it
            return
        try:
            self.parser.feed_data(data)
        except (AttributeError, httptools.HttpParserError) as exc:  # bytes with no request out, or garbled
            raise _garbled(exc) from exc

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser forgets it once the answer ends
        self.got_headers = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _reusable(self) -> bool:
        """An idle connection younger than KEEPALIVE with nothing to read: one the upstream closed (or that
        is out of step) is readable, and an asyncio connection would have seen the same as `connection_lost`."""
        if self.sock is None or time.monotonic() - self.idle_since >= KEEPALIVE:
            return False
        poll = select.poll()  # not select(): it fails on a descriptor above FD_SETSIZE
        poll.register(self.sock, select.POLLIN)
        return not poll.poll(0)

    def _connect(self, deadline: float) -> None:
        timeout = min(self.connect_timeout, deadline - time.monotonic())
        target = self.target
        try:
            if timeout <= 0:
                raise TimeoutError("no time left to connect")
            sock = socket.create_connection((target.host, target.port), timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio sets on its TCP transports
            if target.tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=target.host)
        except (OSError, TimeoutError) as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError("no time left to connect") from exc
            raise UpstreamError(
                f"could not connect to {target.host}:{target.port}: {exc or type(exc).__name__}"
            ) from exc
        self.sock = sock


class BlockingResponse:
    """An answer on a `BlockingConnection`: status and headers at once, the body as it comes; `release` when done."""

    def __init__(self, connection: BlockingConnection) -> None:
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers  # names lower-cased

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    def chunks(self) -> Iterator[bytes]:
        connection = self._connection
        while True:
            taken, connection.chunks = connection.chunks, []
            yield from taken
            if connection.complete:
                return
            connection.receive()

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def release(self) -> None:
        """A connection whose answer ended cleanly stays open for the next request; any other is closed."""
        connection = self._connection
        if connection.complete and connection.keep_alive and connection.sock is not None:
            connection.idle_since = time.monotonic()
        else:
            connection.close()
