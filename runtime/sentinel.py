"""A primary that Sentinel names: the `redis+sentinel://` URL, its config form, and clients that follow it.

Every process (coordinator, worker, gateway, SDK, `saga` commands) takes a Redis URL and makes its
clients through runtime/connect.py. Besides redis-py's own forms (`redis://`, `rediss://`,
`unix://`) the URL may be

    redis+sentinel://[[user]:password@]host:port[,host:port...]/MASTER[/DB]

(`redis+sentinels://` for TLS to both), which asks those sentinels for the current primary of
MASTER. The config's `[redis] sentinels` + `master` say the same and become such a URL
(`sentinel_url`). A Sentinel-backed client asks the sentinels again on every new connection, and
redis-py turns a READONLY reply (the old primary, now demoted) into a ConnectionError after
dropping the connection, so the processes' existing "Redis unreachable: back off and retry" paths
are all it takes to follow a failover. The password in the URL is the data nodes'; the
sentinels are asked without one unless `sentinel_password` is given in the query string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from mcp_saga.schemas.config import MASTER_NAME, SENTINEL_ADDRESS, ConfigError, RedisSettings

SCHEMES = ("redis+sentinel", "redis+sentinels")
_MASTER = re.compile(MASTER_NAME)
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL names (never shown with its password: see `describe`)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    tls: bool = False

    def describe(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"sentinel {hosts} master {self.master} db {self.db}"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


def parse_sentinel_url(url: str, *, where: str = "the Redis URL") -> SentinelTarget:
    """The parts of a `redis+sentinel://` URL, or ConfigError naming `where` and what is wrong."""
    if not is_sentinel_url(url):
        raise ConfigError(f"{where}: not a redis+sentinel:// URL")
    scheme, rest = url.split("://", 1)
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    sentinels = []
    for address in hosts.split(","):
        address = address.strip()
        if address and ":" not in address.strip("[]"):
            address = f"{address}:{DEFAULT_SENTINEL_PORT}"
        match = SENTINEL_ADDRESS.match(address)
        if not match or not 1 <= int(match["port"]) <= 65535:
            raise ConfigError(f"{where}: sentinel address {address!r} is not host:port")
        sentinels.append((match["host"].strip("[]"), int(match["port"])))
    parts = [p for p in path.split("/") if p]
    if not parts or not _MASTER.match(parts[0]):
        raise ConfigError(
            f"{where}: name the monitored primary after the sentinels (redis+sentinel://host:port/MASTER)"
        )
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"{where}: after /{parts[0]} only a database number may follow (/0)")
    options = parse_qs(query)
    unknown = set(options) - {"sentinel_password"}
    if unknown:
        raise ConfigError(f"{where}: unknown option(s) {', '.join(sorted(unknown))} (known: sentinel_password)")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        master=parts[0],
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username,
        password=password,
        sentinel_password=options.get("sentinel_password", [None])[0],
        tls=scheme.lower() == "redis+sentinels",
    )


def sentinel_url(settings: RedisSettings) -> str | None:
    """The URL `[redis] sentinels` + `master` stand for (None when they are not set)."""
    if not settings.sentinels or settings.master is None:
        return None
    return f"redis+sentinel://{','.join(settings.sentinels)}/{quote(settings.master)}/{settings.db}"


def resolve_url(url: str | None, settings: RedisSettings, *, where: str = "--redis / REDIS_URL") -> str | None:
    """The URL a process uses: the one given, else the config's sentinels; both at once is a mistake."""
    configured = sentinel_url(settings)
    if url and configured:
        raise ConfigError(f"both {where} ({redact(url)}) and [redis] sentinels name the Redis: keep one of them")
    if url:
        if is_sentinel_url(url):
            parse_sentinel_url(url, where=where)  # refuse a malformed one now, not at the first command
        return url
    return configured


def redact(url: str) -> str:
    """A URL fit for a log line or an error: the password replaced."""
    parts = urlsplit(url) if not is_sentinel_url(url) else None
    if parts is not None and parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    if parts is None and "@" in url.split("/", 3)[2]:
        scheme, rest = url.split("://", 1)
        userinfo, _, hosts = rest.partition("@")
        user = userinfo.partition(":")[0]
        return f"{scheme}://{user}:***@{hosts}"
    return url


class FollowingConnection(redis.sentinel.SentinelManagedConnection):
    """A primary's connection that asks the sentinels where the primary is on every socket connect.

    redis-py 8 retries a failed command by reconnecting the same connection through
    `connect_check_health`, which reuses the address it had: after a failover that is the dead
    primary, for the whole retry budget (16 s measured with 20 retries), and the command fails
    although a new primary took over within 3 s. Only connects the pool starts itself asked.
    """

    def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()


class FollowingSSLConnection(FollowingConnection, redis.sentinel.SentinelManagedSSLConnection):
    pass


class AsyncFollowingConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """The same for redis.asyncio."""

    async def _connect(self) -> None:
        if self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super()._connect()


class AsyncFollowingSSLConnection(AsyncFollowingConnection, redis.asyncio.sentinel.SentinelManagedSSLConnection):
    pass


def _sentinel_kwargs(target: SentinelTarget) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
    if target.sentinel_password:
        kwargs["password"] = target.sentinel_password
    if target.tls:
        kwargs["ssl"] = True
    return kwargs


def _node_kwargs(target: SentinelTarget, kwargs: dict[str, Any], plain: type, tls: type) -> dict[str, Any]:
    node = {"db": target.db, **kwargs, "connection_class": tls if target.tls else plain}
    if target.username:
        node["username"] = target.username
    if target.password:
        node["password"] = target.password
    return node


def sentinel_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for the primary a `redis+sentinel://` URL names."""
    target = parse_sentinel_url(url)
    sentinel = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    return sentinel.master_for(
        target.master, **_node_kwargs(target, kwargs, FollowingConnection, FollowingSSLConnection)
    )


def sentinel_client_async(url: str, **kwargs: Any) -> redis.asyncio.Redis:
    target = parse_sentinel_url(url)
    sentinel = redis.asyncio.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    return sentinel.master_for(
        target.master, **_node_kwargs(target, kwargs, AsyncFollowingConnection, AsyncFollowingSSLConnection)
    )
