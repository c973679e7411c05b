"""What the Redis underneath promises: its eviction policy and its persistence, read at start-up.

mcp-saga's guarantees assume Redis keeps what it was given. An evicting policy silently destroys
workflow state, the events stream and its consumer group (every per-workflow key has a TTL, so
`volatile-*` policies evict them too); a server without persistence loses every unwind in flight
when it restarts. The coordinator and the worker both call `check_redis`; `saga stats` shows
`inspect_redis`. Managed services often disable `CONFIG`: the facts then come from `INFO`, and
what cannot be known is said to be unknown, never guessed.
"""

from __future__ import annotations

from typing import Any

import msgspec
from redis import Redis
from redis.exceptions import ResponseError

# The only policy under which Redis refuses a write instead of deleting something to make room.
SAFE_POLICY = "noeviction"


class RedisSetupError(RuntimeError):
    """The Redis server is set up in a way that defeats a guarantee, and no override was given."""


class RedisFacts(msgspec.Struct, frozen=True, rename="camel"):
    # None where the server would not say.
    eviction_policy: str | None
    maxmemory: int | None
    # "aof", "rdb", "aof+rdb", "none", or None when unknown (CONFIG disabled and no AOF).
    persistence: str | None

    @property
    def evicting(self) -> bool:
        return self.eviction_policy is not None and self.eviction_policy != SAFE_POLICY


def _info(redis: Redis, section: str) -> dict[str, Any]:
    try:
        return redis.info(section)
    except ResponseError:
        return {}


def inspect_redis(redis: Redis) -> RedisFacts:
    memory = _info(redis, "memory")
    persistence = _info(redis, "persistence")
    policy = memory.get("maxmemory_policy")
    maxmemory = memory.get("maxmemory")
    save: str | None = None
    try:
        config = redis.config_get("maxmemory-policy")
        policy = policy or config.get("maxmemory-policy")
        save = redis.config_get("save").get("save")
    except ResponseError:  # CONFIG renamed or disabled (managed Redis): INFO is all there is
        pass
    aof = bool(int(persistence.get("aof_enabled", 0) or 0))
    rdb = None if save is None else bool(save.strip())
    if aof and rdb:
        mode: str | None = "aof+rdb"
    elif aof:
        mode = "aof"
    elif rdb is None:
        mode = None
    else:
        mode = "rdb" if rdb else "none"
    return RedisFacts(
        eviction_policy=str(policy) if policy is not None else None,
        maxmemory=int(maxmemory) if maxmemory is not None else None,
        persistence=mode,
    )


def check_redis(redis: Redis, *, allow_eviction: bool, log: Any) -> RedisFacts:
    """Refuse an evicting policy unless allowed; warn loudly without persistence. Returns the facts."""
    facts = inspect_redis(redis)
    if facts.evicting:
        why = (
            f"Redis maxmemory-policy is {facts.eviction_policy!r}: under memory pressure it deletes keys, "
            "including workflow state, the events stream and its consumer group, and failed workflows are "
            "then never compensated"
        )
        if not allow_eviction:
            raise RedisSetupError(
                f"{why}. Set `maxmemory-policy {SAFE_POLICY}` on the server, or accept the risk with "
                "`[redis] allow_eviction = true` in the config"
            )
        log.warning("redis may evict keys (allowed by [redis] allow_eviction)", policy=facts.eviction_policy)
    elif facts.eviction_policy is None:
        log.warning("could not read the redis eviction policy; make sure it is noeviction")
    if facts.persistence == "none":
        log.warning(
            "REDIS HAS NO PERSISTENCE: a restart of the server loses every workflow and every unwind in flight, "
            "silently; enable appendonly (or RDB snapshots) on it"
        )
    elif facts.persistence is None:
        log.warning("could not tell whether redis persists its data (CONFIG is disabled and AOF is off)")
    return facts
