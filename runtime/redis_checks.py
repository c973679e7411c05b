"""What the Redis underneath promises: its eviction policy and its persistence, read at start-up.

mcp-saga's guarantees assume Redis keeps what it was given. An evicting policy silently destroys
workflow state, the events stream and its consumer group (every per-workflow key has a TTL, so
`volatile-*` policies evict them too); a server without persistence loses every unwind in flight
when it restarts. The coordinator and the worker both call `check_redis`; `saga stats` shows
`inspect_redis`. Managed services often disable `CONFIG`: the facts then come from `INFO`, and
what cannot be known is said to be unknown, never guessed.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
from redis import Redis
from redis.exceptions import ExecAbortError, OutOfMemoryError, ReadOnlyError, ResponseError

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


# Conditions that heal: a process waits them out (acknowledging nothing), it never exits on them.
# Longest pause between two tries while Redis refuses writes (OOM, read-only replica, failed persistence).
MAX_REFUSAL_BACKOFF = 5.0
SCRIPT_ERROR = re.compile(r"Error running script .*?@user_script: ?\d+: -([A-Z]+) ")
# NOREPLICAS: `min-replicas-to-write` refused a write, or a WAIT fell short (runtime/durability.py).
HEALING = (
    "OOM",
    "NOGROUP",
    "READONLY",
    "MISCONF",
    "BUSY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "LOADING",
    "NOREPLICAS",
)


def healing_condition(exc: BaseException) -> str | None:
    """The condition a Redis error reports, when it is one to wait out instead of exiting on.

    redis-py strips the prefix of the errors it has a class for (OOM, READONLY) and keeps the
    others' (NOGROUP, MISCONF, ...) in the message.
    """
    if isinstance(exc, ExecAbortError) and exc.__context__ is not None:  # MULTI aborted by a queued command's error
        return healing_condition(exc.__context__)
    if not isinstance(exc, ResponseError):
        return None
    if isinstance(exc, OutOfMemoryError):
        return "OOM"
    if isinstance(exc, ReadOnlyError):
        return "READONLY"
    text = str(exc)
    word = text.split(" ", 1)[0]
    inner = SCRIPT_ERROR.search(text)  # raised by redis.call inside a script (ours or RQ's), maybe in a pipeline
    if inner:
        word = inner.group(1)
    if word == "UNBLOCKED":  # Redis 7 ends a blocked XREADGROUP so when its stream (and group) is deleted
        return "NOGROUP"
    return word if word in HEALING else None


class RateLimitedLog:
    """One warning per condition every `every` seconds, with how many were held back meanwhile."""

    def __init__(self, log: Any, every: float = 10.0) -> None:
        self.log = log
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, condition: str, error: str, retry_in: float) -> None:
        now = time.monotonic()
        last, held = self._last.get(condition, (float("-inf"), 0))
        if now - last < self.every:
            self._last[condition] = (last, held + 1)
            return
        self._last[condition] = (now, 0)
        self.log.warning(
            "redis refused a write; nothing acknowledged, retrying",
            condition=condition,
            error=error[:200],
            retry_in=retry_in,
            repeats_held_back=held,
        )
