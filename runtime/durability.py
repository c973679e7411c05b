"""WAIT-based durability: a write counts as acknowledged only once `replicas` replicas have it.

Redis replicates asynchronously: a primary that dies loses the writes it acknowledged but had not
yet sent to a replica, and Sentinel promotes that replica anyway. WAIT blocks until the replicas
confirmed every write the *same connection* made before it, so the WAIT is queued in the pipeline
of the writes it covers (one connection, one round trip). Its reply is a count; fewer than asked
raises `NotReplicated`, a `ResponseError` whose `NOREPLICAS` prefix is the one Redis itself uses
when `min-replicas-to-write` refuses a write, so every process already waits it out and
acknowledges nothing (runtime/redis_checks.py).

On a Redis Cluster the writes of one batch live on several primaries, and a WAIT counts only the
writes of its own connection to its own node; the cluster client's pipeline picks connections per
node itself and, when a slot moved, re-sends commands one by one elsewhere (a WAIT re-sent so
would confirm nothing yet reply with a count). So durable writes go through `Writes`: one plain
pipeline per primary that owns their keys (`get_node_from_key` → that node's own client), each
ended by its WAIT, with no redirection followed behind our back. A MOVED or ASK reply (a
failover or a resharding) or a dead node's connection error refreshes the client's topology and
surfaces as TRYAGAIN, a condition every process waits out before sending the whole batch again
(a write that got through unconfirmed may then be there twice: the coordinator folds the copy to
no change, and a commit's compare-and-set finds its version taken and reloads). The same class
runs the single pipeline of one Redis, so both deployments take one code path.

WAIT does not make Redis strongly consistent: a write that timed out is still on the primary
and may survive or not; a replica that confirmed a write can still lose it if it restarts without
persistence. What it gives is the property the failover test measures: no write a publisher or
the coordinator treated as acknowledged is missing after the confirmed replica is promoted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio
from mcp_saga.schemas.config import RedisSettings
from redis.cluster import RedisCluster
from redis.exceptions import AskError, RedisClusterException, RedisError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# What a node's own connection raises when the slot is served elsewhere now or the node is gone
# (MovedError is an AskError): the cluster's topology is refreshed before the caller tries again.
TOPOLOGY_ERRORS = (AskError, RedisConnectionError, RedisTimeoutError)


class NotReplicated(ResponseError):
    """Fewer replicas than required confirmed a write within the timeout: it is not acknowledged."""


@dataclass(frozen=True, slots=True)
class Durability:
    replicas: int
    timeout_ms: int

    @classmethod
    def of(cls, settings: RedisSettings) -> Durability | None:
        """The durability `[redis] wait_replicas` asks for; None when it is off (0)."""
        if settings.wait_replicas <= 0:
            return None
        return cls(settings.wait_replicas, settings.wait_timeout_ms)

    def queue(self, pipe: Any) -> None:
        """Queue the WAIT behind the writes already queued on `pipe` (sync or asyncio pipeline)."""
        pipe.execute_command("WAIT", *self.args)

    @property
    def args(self) -> tuple[int, int]:
        return self.replicas, self.timeout_ms

    def check(self, acknowledged: Any, what: str = "write") -> None:
        """Raise NotReplicated unless WAIT's reply says enough replicas have the writes."""
        count = int(acknowledged)
        if count < self.replicas:
            raise NotReplicated(
                f"NOREPLICAS {what} confirmed by {count} of {self.replicas} replica(s) within "
                f"{self.timeout_ms} ms: not acknowledged"
            )


def node_client(client: Any, key: str) -> Any:
    """The client of the primary that owns `key`: the node's own `redis.Redis` on a cluster, else `client`."""
    if isinstance(client, RedisCluster):
        return client.get_node_from_key(key).redis_connection
    return client


def topology_changed(exc: BaseException) -> TryAgainError:
    """A redirection or dead node met by a durable write, as the healing TRYAGAIN every process waits out."""
    return TryAgainError(f"TRYAGAIN {type(exc).__name__} ({exc}); the cluster topology was refreshed, send again")


@dataclass
class Writes:
    """One batch of writes, each on the pipeline of the primary owning its key; `execute` gives the
    replies in the order the writes were queued. With `durability`, each node's pipeline ends
    with its WAIT, and every node must confirm (NotReplicated otherwise); without, the batch is
    the client's own pipeline (a cluster pipeline follows redirections by itself)."""

    client: Any
    durability: Durability | None
    _pipes: dict[int, Any] = field(default_factory=dict)
    _order: list[tuple[int, int]] = field(default_factory=list)

    def pipe(self, key: str) -> Any:
        """The pipeline to queue the next write on; queue exactly one command (or script) there."""
        target = node_client(self.client, key) if self.durability is not None else self.client
        pipe = self._pipes.get(id(target))
        if pipe is None:
            pipe = self._pipes[id(target)] = target.pipeline(transaction=False)
        self._order.append((id(target), len(pipe)))
        return pipe

    def execute(self, what: str = "write") -> list[Any]:
        replies: dict[int, list[Any]] = {}
        try:
            for node, pipe in self._pipes.items():
                if self.durability is None:
                    replies[node] = pipe.execute()
                    continue
                self.durability.queue(pipe)
                *replies[node], acknowledged = pipe.execute()
                self.durability.check(acknowledged, what)
        except TOPOLOGY_ERRORS as exc:
            if self.durability is None or not isinstance(self.client, RedisCluster):
                raise
            with contextlib.suppress(RedisError, RedisClusterException):  # no node answers yet: next time
                self.client.nodes_manager.initialize()
            raise topology_changed(exc) from exc
        finally:
            self._pipes.clear()
        order, self._order = self._order, []
        return [replies[node][n] for node, n in order]

    def confirm(self, what: str) -> None:
        """WAIT on every primary, for writes an earlier batch made (see Store.confirm)."""
        if self.durability is None:
            return
        nodes = self.client.get_primaries() if isinstance(self.client, RedisCluster) else [None]
        for node in nodes:
            target = node.redis_connection if node is not None else self.client
            self.durability.check(target.execute_command("WAIT", *self.durability.args), what)


async def node_client_async(client: Any, key: str, clients: dict[str, redis.asyncio.Redis]) -> Any:
    """`node_client` for redis.asyncio: a cluster's nodes have no client of their own there, so one
    is made per primary from the node's connection settings and kept in `clients`."""
    if not isinstance(client, redis.asyncio.RedisCluster):
        return client
    await client.initialize()  # redis.asyncio's cluster client learns the topology lazily (a no-op after)
    node = client.get_node_from_key(key)
    plain = clients.get(node.name)
    if plain is None:
        pool = redis.asyncio.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
        plain = clients[node.name] = redis.asyncio.Redis(connection_pool=pool)
    return plain
