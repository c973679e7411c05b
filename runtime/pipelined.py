"""One long-lived connection to one Redis that pipelines commands from every caller: event writes.

redis-py spends about 80 µs of CPU on each awaited command here (a connection taken from the pool
and given back, a retry wrapper, a task for the drain behind a timeout, a timeout around the read,
observability hooks), against about 10 µs for the command itself; the gateway sends two per call
(the intent and the step-completed). This client does what multiplexing clients do: each command
is packed by hand (RESP is simple), written to the socket as it comes, and its future queued; the
replies, parsed by hiredis, settle the futures in the order the commands were sent. Callers of all
workflows share the connection; order per workflow is the order of their writes, as before.

The SDK's workflows share one per event loop and Redis (`shared_pipelined`): an agent's calls
each write one or two events, and redis-py's cost per XADD was most of what `wf.call` adds to a
call. What it does not do, it leaves to redis-py: a Redis Cluster (MOVED/ASK, a connection per primary),
Sentinel (following a failover) and TLS make `pipelined_for` answer None, and the caller keeps the
ordinary client. A connection that breaks fails every command in flight with redis-py's
`ConnectionError` (a command may have been applied or not: the same uncertainty as any lost
reply), and the next command connects again; one whose oldest reply is `reply_timeout` late (a
stopped Redis) is closed the same way, so no write waits forever.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from mcp_saga.runtime.packing import Arg, hiredis, pack
from mcp_saga.runtime.sentinel import is_sentinel_url
from mcp_saga.schemas.config import RedisSettings
from redis._parsers.base import BaseParser
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.connection import Connection, ConnectionPool, UnixDomainSocketConnection
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

CONNECT_TIMEOUT = 1.0
REPLY_TIMEOUT = 5.0
# Where a connection goes and how it is set up: host, port, Unix path, db, username, password.
_Identity = tuple[str, int, str | None, int, str | None, str | None]


def xadd_args(stream: str, fields: dict[bytes, bytes]) -> list[Arg]:
    args: list[Arg] = ["XADD", stream, "*"]
    for key, value in fields.items():
        args += (key, value)
    return args


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: Pipelined) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.owner._protocol is not self:  # a connection already given up on
            return
        reader, pending = self.reader, self.owner._pending
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self.owner._broken(self, RedisConnectionError(f"Redis sent what is not RESP: {exc}"))
                return
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream is out of step, so nothing after it can be trusted
                self.owner._broken(self, RedisConnectionError("a reply from Redis matched no command"))
                return
            future = pending.popleft()[0]
            if future.done():  # its caller gave up waiting (cancelled)
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(BaseParser.parse_error(str(reply)))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._broken(self, RedisConnectionError(f"connection to Redis lost ({exc or 'closed by the server'})"))


class Pipelined:
    """Commands to one Redis node over one connection, replies matched in order; connects on first use."""

    def __init__(
        self,
        host: str = "localhost",
        port: int = 6379,
        *,
        path: str | None = None,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        reply_timeout: float = REPLY_TIMEOUT,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.reply_timeout = reply_timeout
        self._hello: list[bytes] = []
        if password is not None:
            self._hello.append(pack(["AUTH", username, password] if username else ["AUTH", password]))
        if db:
            self._hello.append(pack(["SELECT", db]))
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        # (future, the time it was sent): futures of `None` stand for the set-up commands' replies.
        self._pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.connects = 0

    async def execute(self, *args: Arg) -> Any:
        """One command; its reply (hiredis's types: bytes, int, list), or the error redis-py would raise."""
        protocol = self._protocol or await self._connect()
        return await self._send(protocol, [pack(args)])[0]

    async def execute_many(self, commands: list[list[Arg]]) -> list[Any]:
        """Several commands in one write (one round trip); every reply, or the first error, once all have come."""
        protocol = self._protocol or await self._connect()
        futures = self._send(protocol, [pack(command) for command in commands])
        return list(await asyncio.gather(*futures))

    async def xadd(self, stream: str, fields: dict[bytes, bytes]) -> bytes:
        protocol = self._protocol or await self._connect()
        return await self._send(protocol, [pack(xadd_args(stream, fields))])[0]  # type: ignore[no-any-return]

    def send_now(self, *args: Arg) -> asyncio.Future[Any] | None:
        """The command written at once and its reply's future, for a caller that must not await (a
        callback); None while there is no connection (the caller then awaits `execute`, which connects)."""
        protocol = self._protocol
        return None if protocol is None else self._send(protocol, [pack(args)])[0]

    async def ping(self) -> bool:
        return await self.execute("PING") in (b"PONG", "PONG")

    def _send(self, protocol: _Protocol, packed: list[bytes]) -> list[asyncio.Future[Any]]:
        loop = asyncio.get_running_loop()
        now = loop.time()
        futures = [loop.create_future() for _ in packed]
        self._pending.extend((future, now) for future in futures)
        assert protocol.transport is not None
        protocol.transport.write(packed[0] if len(packed) == 1 else b"".join(packed))
        if self._timer is None:
            self._timer = loop.call_at(loop.time() + self.reply_timeout, self._check_late)
        return futures

    def _check_late(self) -> None:
        self._timer = None
        if not self._pending or self._protocol is None:
            return
        loop = asyncio.get_running_loop()
        late = self._pending[0][1] + self.reply_timeout - loop.time()
        if late <= 0:
            error = RedisTimeoutError(f"no reply from Redis within {self.reply_timeout:g} s")
            self._broken(self._protocol, error)
            return
        self._timer = loop.call_at(loop.time() + late, self._check_late)

    async def _connect(self) -> _Protocol:
        if self._connecting is not None:  # another caller is connecting: share its connection
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = connecting = loop.create_future()
        try:
            if self.path is not None:
                made = loop.create_unix_connection(lambda: _Protocol(self), self.path)
            else:
                made = loop.create_connection(lambda: _Protocol(self), self.host, self.port)
            try:
                _, protocol = await asyncio.wait_for(made, CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                raise RedisConnectionError(f"could not connect to Redis: {exc or type(exc).__name__}") from exc
            self.connects += 1
            self._protocol = protocol
            if self._hello:
                for reply in await asyncio.gather(*self._send(protocol, self._hello), return_exceptions=True):
                    if isinstance(reply, BaseException):
                        self._broken(protocol, RedisConnectionError(f"Redis refused the connection's set-up: {reply}"))
                        raise reply
            connecting.set_result(protocol)
            return protocol
        except BaseException as exc:
            connecting.set_exception(exc)
            connecting.exception()  # retrieved: a failure nobody else awaited is no "never retrieved" warning
            raise
        finally:
            self._connecting = None

    def _broken(self, protocol: _Protocol, error: Exception) -> None:
        """Fail every command in flight on this connection and drop it: the next command connects again."""
        if protocol.transport is not None:
            protocol.transport.abort()
        if self._protocol is not protocol:  # already dropped (its connection_lost after an abort)
            return
        self._protocol = None
        pending, self._pending = self._pending, collections.deque()
        for future, _ in pending:
            if not future.done():
                future.set_exception(error)

    async def aclose(self) -> None:
        if self._protocol is not None:
            self._broken(self._protocol, RedisConnectionError("closed"))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def pipelined_for(url: str, settings: RedisSettings, *, reply_timeout: float = REPLY_TIMEOUT) -> Pipelined | None:
    """The pipelined connection for `url`, or None where redis-py must stay (cluster, Sentinel, TLS,
    URL options this client does not know, no hiredis)."""
    identity = _url_identity(url, settings)
    return None if identity is None else _made(identity, reply_timeout)


def _url_identity(url: str, settings: RedisSettings) -> _Identity | None:
    if hiredis is None or settings.cluster or is_sentinel_url(url):
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "unix"):
        return None
    options = parse_url(url)
    known = {"host", "port", "path", "db", "username", "password", "connection_class"}
    if set(options) - known:
        return None
    return (
        options.get("host") or "localhost",
        int(options.get("port") or 6379),
        options.get("path"),
        int(options.get("db") or 0),
        options.get("username"),
        options.get("password"),
    )


def _made(identity: _Identity, reply_timeout: float = REPLY_TIMEOUT) -> Pipelined:
    host, port, path, db, username, password = identity
    return Pipelined(host, port, path=path, db=db, username=username, password=password, reply_timeout=reply_timeout)


# Per event loop: its shared connections by the Redis they reach, and what closes them at its end.
_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[dict[_Identity, Pipelined], Any]] = (
    weakref.WeakKeyDictionary()
)


def _identity_of(redis: AsyncRedis | str, settings: RedisSettings) -> _Identity | None:
    """Where a plain connection of `redis` (a client or a URL) goes, or None where only redis-py may go."""
    if isinstance(redis, str):
        return _url_identity(redis, settings)
    pool = getattr(redis, "connection_pool", None)  # a RedisCluster has none; a Sentinel pool is a subclass
    if hiredis is None or settings.cluster or type(pool) is not ConnectionPool:
        return None
    if pool.connection_class not in (Connection, UnixDomainSocketConnection):  # TLS, or a class of the caller's
        return None
    kwargs = pool.connection_kwargs
    if kwargs.get("credential_provider") is not None:  # credentials only redis-py knows how to ask for
        return None
    path = kwargs.get("path")
    return (
        kwargs.get("host") or "localhost",
        int(kwargs.get("port") or 6379),
        path if pool.connection_class is UnixDomainSocketConnection else None,
        int(kwargs.get("db") or 0),
        kwargs.get("username"),
        kwargs.get("password"),
    )


async def _closing(connections: dict[_Identity, Pipelined]) -> AsyncIterator[None]:
    """An async generator the loop closes at its shutdown (`asyncio.run` calls `shutdown_asyncgens`),
    and with it the loop's shared connections: a loop has no other hook for its end."""
    try:
        yield
    finally:
        for pipe in connections.values():
            await pipe.aclose()


async def shared_pipelined(redis: AsyncRedis | str, settings: RedisSettings) -> Pipelined | None:
    """The running loop's pipelined connection to the Redis `redis` reaches, made on first use and
    shared by every caller on the loop; None where redis-py must stay (see `pipelined_for`)."""
    identity = _identity_of(redis, settings)
    if identity is None:
        return None
    loop = asyncio.get_running_loop()
    record = _per_loop.get(loop)
    if record is None:
        connections: dict[_Identity, Pipelined] = {}
        closer = _closing(connections)
        await closer.__anext__()  # started: the loop's asyncgen hooks now track it
        record = _per_loop[loop] = (connections, closer)
    connections = record[0]
    pipe = connections.get(identity)
    if pipe is None:
        pipe = connections[identity] = _made(identity)
    return pipe
