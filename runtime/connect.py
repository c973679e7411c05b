"""Connecting to where the data lives: one Redis, or a Redis Cluster plus a standalone queue.

Every process opens its connections here, so `[redis] cluster` and `[redis] queue_url` mean the
same thing to the coordinator, the workers, the gateway, the SDK and the `saga` command; so does
a `redis+sentinel://` URL (a primary that Sentinel names and the client follows, runtime/sentinel.py). State and
events go through `connect` (a `Redis`, or a `RedisCluster` that follows MOVED redirections and
failovers by itself); RQ's queue through `connect_queue`, always a plain `Redis`, because RQ does
not run on a cluster.

`Lua` runs one script the same way on both: redis-py's cluster pipeline refuses EVALSHA and
`eval()`, and a replica promoted by a failover need not have a script cached (Redis 7 does not
replicate SCRIPT LOAD), so on a cluster the script text goes with each call (EVAL, which Redis
caches by digest); on one Redis it stays redis-py's EVALSHA with the script loaded on NOSCRIPT,
except inside a pipeline: there redis-py sends SCRIPT EXISTS first, a round trip of its own before
every pipeline with a script in it (the coordinator's commit, on the path from a failure to its
compensation), so a pipeline carries the text too (a few KiB, which Redis hashes to its cache entry),
unless its caller queues the script by digest (`Lua.queue`) and handles NOSCRIPT itself: hashing
the text cost Redis about 10 us per call of a 3 KiB script, against 2 us for the EVALSHA.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
from mcp_saga.runtime.packing import pack_with_hiredis
from mcp_saga.runtime.redis_checks import RedisSetupError
from mcp_saga.runtime.sentinel import is_sentinel_url, sentinel_client, sentinel_client_async
from mcp_saga.schemas.config import RedisSettings
from mcp_saga.schemas.keys import Keys
from redis.cluster import RedisCluster
from redis.commands.core import Script

Client = redis.Redis | RedisCluster


def connect(url: str, settings: RedisSettings, **options: Any) -> Client:
    """The client for events and state (`options` are redis-py's, e.g. `retry=`).

    A `redis+sentinel://` URL gives a client of the primary Sentinel names (runtime/sentinel.py).
    """
    if settings.cluster:
        return RedisCluster.from_url(url, **options)
    return _standalone(url, **options)


def connect_async(
    url: str, settings: RedisSettings, **options: Any
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """The asyncio client for events and state: what the gateway and the async SDK publish with."""
    if settings.cluster:
        return redis.asyncio.RedisCluster.from_url(url, **options)
    if is_sentinel_url(url):
        return sentinel_client_async(url, **options)
    return redis.asyncio.Redis.from_url(url, **options)


def connect_queue(url: str, settings: RedisSettings, **options: Any) -> redis.Redis:
    """The RQ queue's client: `queue_url` when set (a Sentinel URL too), else the same Redis as the state."""
    return _standalone(settings.queue_url or url, **options)


def _standalone(url: str, **options: Any) -> redis.Redis:
    if is_sentinel_url(url):
        return sentinel_client(url, **options)
    return pack_with_hiredis(redis.Redis.from_url(url, **options))


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster | redis.asyncio.RedisCluster) or type(client).__name__ == "ClusterPipeline"


class Lua:
    """One Lua script, callable on a client or inside a pipeline of either kind."""

    def __init__(self, client: Client, text: str) -> None:
        self.client, self.text = client, text
        self._script: Script | None = None if is_cluster(client) else client.register_script(text)  # type: ignore[union-attr]

    @property
    def sha(self) -> str:
        """The script's digest, for an EVALSHA sent by hand (one Redis only: a cluster sends the text)."""
        assert self._script is not None, "EVALSHA by hand is for one Redis, not a cluster"
        return self._script.sha

    def __call__(self, keys: list[str] | tuple[str, ...], args: list[Any], client: Any = None) -> Any:
        """Run it on `client` (a pipeline, say), else on the client it was made for."""
        if self._script is not None and not isinstance(client, redis.client.Pipeline):
            return self._script(keys=keys, args=args, client=client)
        return evaluate(client or self.client, self.text, keys, args)

    def queue(self, pipe: Any, keys: list[str] | tuple[str, ...], args: list[Any]) -> None:
        """Queue it on `pipe` by digest (EVALSHA) on one Redis, the text on a cluster.

        No SCRIPT EXISTS goes first: a Redis without the script (restarted, failed over, flushed)
        answers NoScriptError in that command's place, having run nothing of it; the caller
        `load`s it before that command goes again.
        """
        if self._script is None:
            evaluate(pipe, self.text, keys, args)
        else:
            pipe.execute_command("EVALSHA", self._script.sha, len(keys), *keys, *args)

    def load(self) -> None:
        """Put the script in the Redis script cache (after a NoScriptError)."""
        if self._script is not None:
            self.client.script_load(self.text)


def evaluate(client: Any, text: str, keys: list[str] | tuple[str, ...], args: list[Any] | tuple[Any, ...]) -> Any:
    """EVAL on a client or pipeline of either kind (the text each time: see the module's doc).

    On a cluster the node is named up front: without it, redis-py 8's cluster pipeline asks the
    server (COMMAND GETKEYS, one round trip per EVAL) where each script's keys are. A MOVED reply
    (the slot moved meanwhile) is still followed: the retry routes by the keys.
    """
    options = {}
    if is_cluster(client) and keys:
        options["target_nodes"] = client.get_node_from_key(keys[0])
    return client.execute_command("EVAL", text, len(keys), *keys, *args, **options)


def check_layout(client: Client, keys: Keys) -> None:
    """Refuse to run with another partition count than the data was written with.

    Publishers route by the count, and a coordinator reads only its partitions' streams: two
    counts in one deployment would leave events in streams nobody reads. A deployment of several
    partitions records its count (`saga:partitions`); none recorded means one, as every deployment
    before partitions was, so a single-partition process writes nothing here (and starts under OOM).
    Changing the count is a migration (README, "Running on Redis Cluster"), not a restart.
    """
    recorded = client.get(keys.layout)
    if recorded is None and keys.partitions > 1:
        if client.exists(Keys(keys.prefix).events):  # a one-partition deployment's stream is here
            recorded = b"1"
        else:
            client.set(keys.layout, keys.partitions, nx=True)
            recorded = client.get(keys.layout)
    found = int(recorded) if recorded is not None else 1
    if found != keys.partitions:
        raise RedisSetupError(
            f"this Redis holds data written with {found} partition(s) ({keys.layout}), but the config "
            f"says [redis] partitions = {keys.partitions}: set it back, or migrate (README: Running on Redis Cluster)"
        )


def node_of(client: object, key: str) -> str | None:
    """`host:port` of the primary holding `key` on a cluster; None on a single Redis (it holds everything)."""
    if not isinstance(client, RedisCluster):
        return None
    node = client.get_node_from_key(key)
    return f"{node.host}:{node.port}" if node is not None else None
