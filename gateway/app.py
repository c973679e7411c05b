"""Serving the gateway: streamable HTTP at `/mcp/<server>` behind a bearer token, or stdio for one server.

The token comes from the environment variable the config names, never from a file or the command
line (both end up in logs and process lists), and is compared in constant time. Without one the
HTTP side does not start, unless the config allows anonymous access on a loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis.asyncio as aioredis
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from mcp_saga.gateway.passthrough import PassThrough, Upstreams
from mcp_saga.gateway.proxy import Gateway
from mcp_saga.gateway.recorder import Recorder
from mcp_saga.runtime.collector import tune_gc
from mcp_saga.runtime.connect import connect_async
from mcp_saga.runtime.durability import Durability
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.pipelined import REPLY_TIMEOUT, pipelined_for
from mcp_saga.schemas.config import Config, ConfigError, RedisSettings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

log = get_logger("gateway")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def gateway_token(config: Config) -> str | None:
    """The bearer token from the environment; ConfigError when it is required and missing."""
    settings = config.gateway
    token = os.environ.get(settings.token_env) or None
    if token is None and not settings.allow_anonymous:
        raise ConfigError(
            f"the gateway needs a bearer token: set the environment variable {settings.token_env} "
            "(or `[gateway] allow_anonymous = true` on a loopback host)"
        )
    return token


class BearerAuth:
    """Refuse every request without `Authorization: Bearer <token>` (401), before the MCP layer sees it."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None:
            given = next((value for key, value in scope.get("headers") or () if key == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = json.dumps({"error": "unauthorized: send Authorization: Bearer <token>"}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b'Bearer realm="mcp-saga-gateway"'),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def connect_redis(url: str, settings: RedisSettings | None = None) -> aioredis.Redis:
    # Retries as in the SDK: a Redis restart of a few milliseconds must not lose a step.
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), 3)
    return connect_async(url, settings or RedisSettings(), retry=retry)  # type: ignore[return-value]


def recorder_for(config: Config, url: str) -> Recorder:
    durability = Durability.of(config.redis)
    # A reply later than this closes the pipelined connection (a stopped Redis): WAIT may take its timeout.
    reply_timeout = REPLY_TIMEOUT + (durability.timeout_ms / 1000 if durability is not None else 0.0)
    return Recorder(
        connect_redis(url, config.redis),
        config.prefix,
        retry_for=config.gateway.publish_retry_for,
        partitions=config.redis.partitions,
        durability=durability,
        pipe=pipelined_for(url, config.redis, reply_timeout=reply_timeout),
    )


@contextlib.asynccontextmanager
async def running(gateway: Gateway) -> AsyncIterator[None]:
    """The gateway's background work: the Redis health probe and the idle policy."""
    tasks = [
        asyncio.create_task(gateway.recorder.watch_health()),
        asyncio.create_task(_idle_sweeper(gateway)),
        asyncio.create_task(_warm(gateway)),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for workflow in list(gateway.recorder.workflows):
            await gateway.recorder.flush(workflow)
        await gateway.sessions.aclose()
        await gateway.recorder.publisher.redis.aclose()
        if gateway.recorder.publisher.pipe is not None:
            await gateway.recorder.publisher.pipe.aclose()


async def _warm(gateway: Gateway) -> None:
    """Read each HTTP upstream's listing at start: opening the session that reads the live declarations
    costs about half a second of CPU (imports, TLS context), which the first recorded call would wait for."""
    for name, server in gateway.config.servers.items():
        if server.url is None:
            continue
        try:
            await gateway.sessions.tools(name)
        except Exception as exc:  # not up yet: the first call reads it then
            log.warning("upstream listing not read at start", server=name, error=repr(exc))


async def _idle_sweeper(gateway: Gateway) -> None:
    settings = gateway.settings
    every = min(30.0, settings.idle_timeout / 4)
    while True:
        await asyncio.sleep(every)
        for workflow in gateway.recorder.idle(settings.idle_timeout):
            await gateway.recorder.apply_policy(workflow, settings.on_idle, "idle")
            gateway.recorder.forget(workflow)


def http_app(config: Config, redis_url: str, token: str | None) -> tuple[BearerAuth, Gateway]:
    """The ASGI app serving `/mcp/<server>` for every registry server, and the gateway behind it.

    A server with a `url` gets the pass-through (`gateway.passthrough`); one the gateway must spawn
    (`command`) is fronted by the SDK server of `gateway.proxy`, as over stdio.
    """
    settings = config.gateway
    recorder = recorder_for(config, redis_url)
    gateway = Gateway(config, recorder)
    security = None
    if settings.host in LOOPBACK:
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    http = Upstreams()
    checks = TransportSecurityMiddleware(security) if security is not None else None
    passed = {name: PassThrough(gateway, name, http, checks) for name, server in config.servers.items() if server.url}
    managers = {
        name: StreamableHTTPSessionManager(
            app=server, security_settings=security, session_idle_timeout=settings.idle_timeout
        )
        for name, server in gateway.endpoints.items()
        if name not in passed
    }
    routes = [Route(f"/mcp/{name}", endpoint=app) for name, app in passed.items()]  # for Starlette's redirects
    routes += [Route(f"/mcp/{name}", endpoint=StreamableHTTPASGIApp(manager)) for name, manager in managers.items()]

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running(gateway))
            await stack.enter_async_context(http)
            for manager in managers.values():
                await stack.enter_async_context(manager.run())
            log.info("gateway serving", servers=",".join(config.servers), host=settings.host, port=settings.port)
            yield

    app = Starlette(routes=routes, lifespan=lifespan)
    return BearerAuth(_Direct({f"/mcp/{name}": endpoint for name, endpoint in passed.items()}, app), token), gateway


class _Direct:
    """Pass-through paths straight to their endpoint; the rest (lifespan, SDK endpoints, 404s) to Starlette,
    whose routing and middleware stack cost a pass-through call about as much as its own parsing."""

    def __init__(self, paths: dict[str, ASGIApp], app: ASGIApp) -> None:
        self.paths, self.app = paths, app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.paths.get(scope["path"]) if scope["type"] == "http" else None
        await (endpoint or self.app)(scope, receive, send)


class _Coalescing:
    """A connection's transport whose writes of one event-loop step go out as one: uvicorn writes a
    response's head and its body separately, two segments that wake the client twice; held until
    the loop's next step, they leave in one write (nothing waits longer than that step)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            asyncio.get_running_loop().call_soon(self._flush)
        self._held.append(data)

    def _flush(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _http_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class Protocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_Coalescing(transport))  # type: ignore[arg-type]

    return Protocol


def serve_http(config: Config, redis_url: str, *, host: str | None = None, port: int | None = None) -> int:
    import uvicorn

    if not config.servers:
        raise ConfigError("the gateway needs a config naming the MCP servers it fronts ([servers.NAME])")
    token = gateway_token(config)
    app, _ = http_app(config, redis_url, token)
    tune_gc()
    settings = config.gateway
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=host or settings.host,
            port=port if port is not None else settings.port,
            log_level="warning",
            lifespan="on",
            # Per-request work the gateway has no use for: it never reads the client's address, and
            # logs what it records itself. uvicorn's httptools protocol, its writes coalesced (`_Coalescing`).
            http=_http_protocol(),
            # Named, never "auto" (which picks uvloop whenever it happens to be installed).
            loop=settings.loop,
            proxy_headers=False,
            access_log=False,
            server_header=False,
            date_header=False,
        )
    ).run()
    return 0


def serve_stdio(config: Config, redis_url: str, server: str) -> int:
    """One registry server over stdio, for hosts that spawn their MCP servers; the process is the session."""
    if server not in config.servers:
        raise ConfigError(f"server {server!r} is not in the config's [servers] (known: {', '.join(config.servers)})")
    only = config.model_copy(update={"servers": {server: config.servers[server]}})
    recorder = recorder_for(config, redis_url)
    gateway = Gateway(only, recorder, stdio=True)
    endpoint = gateway.endpoints[server]

    async def main() -> None:
        async with running(gateway), stdio_server() as (read, write):
            try:
                await endpoint.run(read, write, endpoint.create_initialization_options())
            finally:
                workflow = gateway.stdio_workflow
                assert workflow is not None
                await recorder.apply_policy(workflow, config.gateway.on_session_end, "session ended")

    anyio.run(main)
    return 0
