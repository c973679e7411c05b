"""Warm MCP sessions for synchronous code (the RQ job), one per configured server.

Connecting costs 0.6-0.9 s for a stdio server and a warm call about 2 ms, so a worker keeps its
sessions open across jobs. The SDK's sessions are anyio-based and must be closed by the task that
opened them, so each server gets one long-lived owner task on a private event loop in a background
thread: it holds `async with Client(...)` and serves requests from a queue, each as its own task.
Sync callers submit with `run_coroutine_threadsafe` and block on the answer.

Failures come back as `SessionError`s that say whether trying again can help: the job classifies
them, the pool only reconnects.

The worker's `call_tool` over streamable HTTP skips the SDK's client once the session is up: one
POST on runtime/http_client.py, built and read as the SDK would (runtime/lean_call.py), sent and
read by the calling thread itself on a blocking keep-alive connection of its own (`_direct`): the
hand-over to the loop's thread and back cost more than the POST. The loop still connects, lists
tools and serves whatever needs the SDK's session.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio
import httpx2
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.session import MessageHandlerFnT
from mcp.client.streamable_http import streamable_http_client
from mcp_saga.runtime import tracing
from mcp_saga.runtime.http_client import BlockingConnection, UpstreamError
from mcp_saga.runtime.lean_call import LeanChannel, NotLean
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.recovery_wire import ToolDeclaration, read_tool_declarations
from mcp_saga.schemas.config import ServerConfig
from mcp_types import (
    CONNECTION_CLOSED,
    HEADER_MISMATCH,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    Implementation,
)
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

log = get_logger("sessions")
T = TypeVar("T")

# Seconds a server's places may all be held before it counts as stuck rather than busy (`slot`).
SLOT_PATIENCE = 2.0
# A streamable HTTP response may be an SSE stream the server holds open while the tool runs.
HTTP_READ_TIMEOUT = 300.0

# How mcp-saga introduces itself in `clientInfo`, so that a server's logs tell a compensation
# (`mcp-saga-worker`) and a call recorded by the gateway (`mcp-saga-gateway`) from other clients.
WORKER_CLIENT = "mcp-saga-worker"
GATEWAY_CLIENT = "mcp-saga-gateway"


def client_info(name: str) -> Implementation:
    try:
        version = importlib.metadata.version("mcp-saga")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    return Implementation(name=name, version=version)


class SessionError(Exception):
    """A call that did not produce a result; `retryable` says whether the same call may yet work."""

    retryable = True


class TransportError(SessionError):
    """The connection failed or broke; the owner reconnects, the call may be retried."""


class CallTimeout(SessionError):
    """No answer within the server's timeout; the call may still have taken effect."""


class ProtocolError(SessionError):
    """The server answered with a JSON-RPC error instead of a result."""

    def __init__(self, code: int, message: str):
        super().__init__(f"MCP error {code}: {message}")
        self.code = code
        # The same request cannot fix a method the server does not have or params it rejects.
        self.retryable = code not in (METHOD_NOT_FOUND, INVALID_PARAMS)


class InvalidResult(SessionError):
    """The result broke the tool's own output schema: asking again returns the same result."""

    retryable = False


class UnknownServer(SessionError):
    """The name is not in this worker's registry; workers never call servers named only by events."""

    retryable = False


class _Reconnect(Exception):
    """Raised inside the owner's task group to drop a session the server has closed."""


_CLOSE = object()


@dataclass(eq=False)
class _Request:
    run: Callable[[Client], Awaitable[Any]]
    future: asyncio.Future[Any]


class _Owner:
    """The one task that opens, uses and closes a server's session, reconnecting after failures."""

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        *,
        backoff: tuple[float, float] = (0.1, 2.0),
        client_name: str = WORKER_CLIENT,
        message_handler: MessageHandlerFnT | None = None,
        mode: str = "auto",
        lean: bool = False,
    ):
        self.name, self.config = name, config
        self.mode = mode
        # The current connection's direct line for `tools/call` (streamable HTTP only, when asked for).
        self.lean: LeanChannel | None = None
        self.lean_wanted = lean and config.url is not None
        self.info = client_info(client_name)
        self.message_handler = message_handler
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.backoff = backoff
        self.delay = 0.0
        self.connects = 0
        self.tools: tuple[float, dict[str, ToolDeclaration]] | None = None
        self.inflight: set[_Request] = set()
        # The connected session's client, while there is one (read by `SessionPool`'s calls from other threads),
        # and what is set once it is gone.
        self.live: Client | None = None
        self.ended = asyncio.Event()

    def submit(self, request: _Request | object) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.own(), name=f"mcp-session:{self.name}")
        self.queue.put_nowait(request)

    async def own(self) -> None:
        while True:
            request = await self.queue.get()  # connect lazily, when there is work
            if request is _CLOSE:
                return
            if self.delay:
                await asyncio.sleep(self.delay)
            try:
                if await self.serve(request):
                    return
            except (Exception, BaseExceptionGroup) as exc:  # a group may also hold its tasks' cancellations
                error = TransportError(f"{self.name}: {_describe(exc)}")
                self.tools = None
                self.delay = min(self.backoff[1], self.delay * 2 or self.backoff[0])
                log.warning("mcp session failed", server=self.name, error=str(error), reconnect_in=self.delay)
                for pending in (request, *self.inflight):
                    _fail(pending, error)
                self.inflight.clear()

    async def serve(self, first: _Request) -> bool:
        """Connect, then serve until closed (True) or the session breaks (raises)."""
        with anyio.CancelScope() as connecting:
            timer = asyncio.get_running_loop().call_later(self.config.timeout, connecting.cancel)
            async with self.client() as client, anyio.create_task_group() as tasks:
                timer.cancel()
                self.connects += 1
                self.delay = 0.0
                log.info("mcp session connected", server=self.name, target=self.target())
                self.live, self.ended = client, asyncio.Event()
                try:
                    request = first
                    while request is not _CLOSE:
                        tasks.start_soon(self.run, client, request)
                        request = await self.queue.get()
                finally:
                    self.live = None
                    self.ended.set()
                tasks.cancel_scope.cancel()
            for pending in self.inflight:
                _fail(pending, TransportError(f"{self.name}: session closed during the call"))
            return True
        raise TimeoutError(f"no session within {self.config.timeout:g}s")

    async def run(self, client: Client, request: _Request) -> None:
        if request.future.done():  # the caller gave up while it waited
            return
        self.inflight.add(request)
        with anyio.CancelScope() as scope:
            request.future.add_done_callback(lambda _: scope.cancel())
            try:
                result = await request.run(client)
            except Exception as exc:
                error, broken = _classify(self.name, exc)
                _fail(request, error)
                if broken and isinstance(exc, MCPError):
                    raise _Reconnect from exc
                if broken:
                    raise
            else:
                if not request.future.done():
                    request.future.set_result(result)
        # Not reached when the session broke under the call: `own` fails it with the cause.
        self.inflight.discard(request)

    def client(self) -> Client:
        if self.config.url is not None:
            headers = self.config.headers()
            if self.lean_wanted:
                # A server the lean path gave up on stays with the SDK across reconnects.
                usable = self.lean is None or self.lean.usable
                self.lean = LeanChannel(self.config.url, headers, self.config.timeout)
                self.lean.usable = usable
            transport = _http_transport(self.config.url, headers, self.config.timeout, self.lean)
            return Client(
                transport, cache=None, client_info=self.info, message_handler=self.message_handler, mode=self.mode
            )
        command = self.config.command or []
        params = StdioServerParameters(
            command=command[0], args=command[1:], env=self.config.env or None, cwd=self.config.cwd
        )
        return Client(params, cache=None, client_info=self.info, message_handler=self.message_handler, mode=self.mode)

    def target(self) -> str:
        target = self.config.url or " ".join(self.config.command or [])
        return target if len(target) <= 120 else target[:117] + "..."

    async def drop(self, client: Client, cause: Exception) -> None:
        """End a session that a call made outside the loop found broken, as a call on the loop that broke would
        have (the calls in flight on it fail), and return once it is gone: the caller's next call reconnects."""
        if self.live is not client:  # already gone
            return
        ended = self.ended

        async def broken(_: Client) -> None:
            raise _Reconnect from cause

        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda done: done.exception())  # its error is for the log, not for a caller
        self.submit(_Request(broken, future))
        await ended.wait()


def _classify(server: str, exc: Exception) -> tuple[SessionError, bool]:
    """What a call's exception is to its caller, and whether the session it was made on is broken."""
    if isinstance(exc, MCPError):
        if exc.code == CONNECTION_CLOSED or (exc.code == INVALID_REQUEST and "terminated" in str(exc)):
            return TransportError(f"{server}: {exc}"), True
        return ProtocolError(exc.code, str(exc)), False
    if isinstance(exc, RuntimeError | ValueError):  # the SDK's output-schema and model validation
        return InvalidResult(f"{server}: {exc}"), False
    return TransportError(f"{server}: {_describe(exc)}"), True


@contextlib.asynccontextmanager
async def _http_transport(
    url: str, headers: dict[str, str], timeout: float, lean: LeanChannel | None = None
) -> AsyncIterator[Any]:
    """Streamable HTTP with headers: the SDK takes them only through a caller-owned httpx client.

    With a lean channel, the channel sees each answer the SDK gets (for the session id) and its
    connections close with the session."""
    limits = httpx2.Timeout(timeout, read=max(timeout, HTTP_READ_TIMEOUT))
    hooks = {"response": [lean.saw_response]} if lean is not None else None
    async with contextlib.AsyncExitStack() as stack:
        if lean is not None:
            await stack.enter_async_context(lean.upstreams)
        http = await stack.enter_async_context(httpx2.AsyncClient(headers=headers, timeout=limits, event_hooks=hooks))
        yield await stack.enter_async_context(streamable_http_client(url, http_client=http))


def _at_once(coro: Coroutine[Any, Any, T]) -> T:
    """Run, in this thread, a coroutine known to finish without suspending (`LeanChannel.settles_at_once`)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise AssertionError("a coroutine that was to finish at once waited")


def _fail(request: Any, error: SessionError) -> None:
    if isinstance(request, _Request) and not request.future.done():
        request.future.set_exception(error)


def _describe(exc: BaseException) -> str:
    """The innermost messages of an exception group: the connect error, not "unhandled errors"."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions)
    if isinstance(exc, _Reconnect) and exc.__cause__ is not None:
        return _describe(exc.__cause__)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class AsyncSessions:
    """One warm session per configured server for code already on an event loop (the gateway).

    The same owner tasks as `SessionPool`, without the thread: call from the loop the sessions
    live on, and close from it.
    """

    def __init__(
        self,
        servers: dict[str, ServerConfig],
        *,
        tools_ttl: float = 30.0,
        client_name: str = WORKER_CLIENT,
        message_handler: Callable[[str], MessageHandlerFnT] | None = None,
        mode: str = "auto",
        lean: bool = False,
    ):
        self.servers = dict(servers)
        self.tools_ttl = tools_ttl
        self.client_name = client_name
        self.message_handler = message_handler
        self.mode = mode
        self.lean = lean
        self._owners: dict[str, _Owner] = {}
        self._lock = threading.Lock()

    def config(self, server: str) -> ServerConfig:
        config = self.servers.get(server)
        if config is None:
            raise UnknownServer(f"server {server!r} is not in the registry of this worker or gateway")
        return config

    def owner(self, server: str) -> _Owner:
        config = self.config(server)
        with self._lock:
            owner = self._owners.get(server)
            if owner is None:
                handler = self.message_handler(server) if self.message_handler else None
                owner = _Owner(
                    server,
                    config,
                    client_name=self.client_name,
                    message_handler=handler,
                    mode=self.mode,
                    lean=self.lean,
                )
                self._owners[server] = owner
            return owner

    async def request(self, server: str, run: Callable[[Client], Awaitable[T]], timeout: float | None = None) -> T:
        """Run `run(client)` on the server's warm session; a `SessionError` when no result came back."""
        owner = self.owner(server)
        timeout = timeout or owner.config.timeout
        request = _Request(run, asyncio.get_running_loop().create_future())
        owner.submit(request)
        try:
            return await asyncio.wait_for(request.future, timeout)
        except TimeoutError:
            raise CallTimeout(f"{owner.name}: no answer within {timeout:g} s") from None

    async def tools(self, server: str, refresh: bool = False) -> dict[str, ToolDeclaration]:
        """The server's live `tools/list`, recovery declarations included, cached `tools_ttl` seconds."""
        owner = self.owner(server)
        if owner.tools and not refresh and time.monotonic() < owner.tools[0]:
            return owner.tools[1]
        declarations = await self.request(server, read_tool_declarations, owner.config.timeout)
        owner.tools = (time.monotonic() + self.tools_ttl, declarations)
        return declarations

    def forget_tools(self, server: str) -> None:
        """Drop a cached listing, e.g. after the server announced `tools/list_changed`."""
        owner = self._owners.get(server)
        if owner is not None:
            owner.tools = None

    def connects(self, server: str) -> int:
        owner = self._owners.get(server)
        return owner.connects if owner else 0

    async def aclose(self) -> None:
        """Close every session from its owning task."""
        tasks = []
        for owner in self._owners.values():
            if owner.task is not None and not owner.task.done():
                owner.queue.put_nowait(_CLOSE)
                tasks.append(owner.task)
        await asyncio.gather(*tasks, return_exceptions=True)


class SessionPool:
    """One warm session per configured server, usable from any thread.

    Nothing connects until a server is first used, so a worker that starts while a server is down
    still starts; the loop thread itself also starts on first use (RQ forks its scheduler at start,
    and a fork should not copy a running event loop).
    """

    def __init__(self, servers: dict[str, ServerConfig], *, tools_ttl: float = 30.0, per_server: int | None = None):
        self.servers = dict(servers)
        self.tools_ttl = tools_ttl
        self.per_server = per_server
        # When each caller holding a server's places took it (SessionPool.slot).
        self._holders: dict[str, list[float]] = {}
        self._slots = threading.Condition()
        # Lean `tools/call`s (runtime/lean_call.py): the worker's calls, with no message handler to serve.
        self._sessions = AsyncSessions(servers, tools_ttl=tools_ttl, lean=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Each calling thread's own connections (`_direct`), and all of them, to close with the pool.
        self._local = threading.local()
        self._blocking: list[BlockingConnection] = []

    def call_tool(
        self,
        server: str,
        name: str,
        arguments: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The CallToolResult as on the wire (camelCase); `isError` results are results, not errors.

        Over streamable HTTP the call goes out on the lean channel, unless the MCP SDK's own spans are
        recorded (they would be missing) or the channel stepped aside for this server."""
        owner = self._sessions.owner(server)
        wait = timeout or owner.config.timeout
        live, channel = owner.live, owner.lean
        if live is not None and channel is not None and channel.ready(live.session) and not tracing.sdk_spans():
            with contextlib.suppress(NotLean):
                direct = self._direct(owner, live, channel, name, arguments or {}, meta, wait)
                if direct is not None:
                    return direct

        async def call(client: Client) -> dict[str, Any]:
            lean = owner.lean
            result = None
            if lean is not None and lean.ready(client.session) and not tracing.sdk_spans():
                with contextlib.suppress(NotLean):
                    result = await lean.call_tool(client, name, arguments or {}, meta, wait)
            if result is None:
                with tracing.continued(meta):  # the caller's trace, which the MCP SDK passes on in `_meta`
                    result = await client.call_tool(name, arguments or {}, meta=meta)
            return result.model_dump(by_alias=True, mode="json", exclude_none=True)

        return self._submit(server, call, timeout)

    def _direct(
        self,
        owner: _Owner,
        client: Client,
        lean: LeanChannel,
        name: str,
        arguments: dict[str, Any],
        meta: dict[str, Any] | None,
        timeout: float,
    ) -> dict[str, Any] | None:
        """The lean call made by the calling thread on a connection of its own, with no hand-over to the loop's
        thread and back; None when the loop must make it after all (the server refused it unrun). What needs the
        SDK's session (a listing to fetch for the output schema, input-required rounds) goes to the loop."""
        session = client.session
        try:
            try:
                connection = self._connection(owner.name, lean)
                raw = lean.send_blocking(connection, session, name, arguments, meta, time.monotonic() + timeout)
            except MCPError as refused:
                if refused.code == HEADER_MISMATCH and session.protocol_version in MODERN_PROTOCOL_VERSIONS:
                    return None  # a stale listing: the loop's call re-lists the tools and sends it once more
                raise
            result = lean.result_of(session, name, raw)
            if lean.settles_at_once(session, name, result):
                settled = _at_once(lean.settle(client, name, arguments, meta, result))
            else:
                settled = self._submit(
                    owner.name, lambda _: lean.settle(client, name, arguments, meta, result), timeout
                )
        except TimeoutError:
            raise CallTimeout(f"{owner.name}: no answer within {timeout:g} s") from None
        except (MCPError, UpstreamError, OSError, RuntimeError, ValueError) as exc:  # not NotLean, not RQ's timeout
            error, broken = _classify(owner.name, exc)
            if broken:
                with contextlib.suppress(SessionError):
                    self._run(owner.drop(client, exc), owner.config.timeout)
            raise error from exc
        return settled.model_dump(by_alias=True, mode="json", exclude_none=True)

    def _connection(self, server: str, lean: LeanChannel) -> BlockingConnection:
        """This thread's connection to the server (kept across jobs and reconnected sessions)."""
        held: dict[str, BlockingConnection] = self._local.__dict__.setdefault("connections", {})
        connection = held.get(server)
        if connection is None or connection.target != lean.target:
            connection = held[server] = BlockingConnection(lean.target, lean.connect_timeout)
            with self._lock:
                self._blocking.append(connection)
        return connection

    @contextlib.contextmanager
    def slot(self, server: str) -> Iterator[bool]:
        """Claim one of the `per_server` places a server may hold; yields False when none comes free.

        The pool's own calls never wait on each other (one task per call on one loop); what a hung
        server can exhaust is the callers' threads, so the caller that gets False should not call.
        A server at its limit whose places were all taken less than SLOT_PATIENCE seconds ago is
        busy, not stuck (fast calls, or a session still connecting at start-up): the caller waits
        for a place, until the oldest holder has held it SLOT_PATIENCE seconds. After that the
        server counts as stuck and the answer is an immediate False.
        """
        since = time.monotonic()
        with self._slots:
            holders = self._holders.setdefault(server, [])
            while self.per_server is not None and len(holders) >= self.per_server:
                remaining = min(holders) + SLOT_PATIENCE - time.monotonic()
                if remaining <= 0:
                    break
                self._slots.wait(remaining)
            free = self.per_server is None or len(holders) < self.per_server
            if free:
                holders.append(since)
        try:
            yield free
        finally:
            if free:
                with self._slots:
                    holders.remove(since)
                    self._slots.notify()

    def tools(self, server: str, *, refresh: bool = False) -> dict[str, ToolDeclaration]:
        """The server's live `tools/list`, recovery declarations included, cached `tools_ttl` seconds."""
        cached = None if refresh else self._sessions.owner(server).tools
        if cached and time.monotonic() < cached[0]:  # no trip through the loop for a fresh listing
            return cached[1]
        return self._run(self._sessions.tools(server, refresh), self._sessions.config(server).timeout)

    def connects(self, server: str) -> int:
        """How many times the server was connected (for tests and the benchmark)."""
        return self._sessions.connects(server)

    def close(self, timeout: float = 10.0) -> None:
        """Close every session from its owning task, then stop the loop thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._sessions.aclose(), loop).result(timeout)
        except Exception as exc:
            log.error("closing mcp sessions failed", error=_describe(exc), exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        for connection in self._blocking:
            connection.close()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Thread side.

    def _submit(self, server: str, run: Callable[[Client], Awaitable[T]], timeout: float | None) -> T:
        timeout = timeout or self._sessions.config(server).timeout
        return self._run(self._sessions.request(server, run, timeout), timeout)

    def _run(self, coro: Awaitable[T], timeout: float) -> T:
        try:
            loop = self._ensure_loop()
        except TransportError:
            coro.close()  # type: ignore[attr-defined]
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]
        try:
            # The coroutine enforces `timeout`; the margin only guards against a stuck loop.
            return future.result(timeout + 5.0)
        except TimeoutError:
            raise CallTimeout(f"event loop did not answer within {timeout:g}s") from None
        finally:
            future.cancel()  # an RQ job timeout interrupts us here: do not leave the call running

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise TransportError("session pool is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-sessions", daemon=True)
                self._thread.start()
            return self._loop
