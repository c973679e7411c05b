"""WAIT-based durability: a write counts as acknowledged only once `replicas` replicas have it.

Redis replicates asynchronously: a primary that dies loses the writes it acknowledged but had not
yet sent to a replica, and Sentinel promotes that replica anyway. WAIT blocks until the replicas
confirmed every write the *same connection* made before it, so the WAIT is queued in the pipeline
of the writes it covers (one connection, one round trip). Its reply is a count; fewer than asked
raises `NotReplicated`, a `ResponseError` whose `NOREPLICAS` prefix is the one Redis itself uses
when `min-replicas-to-write` refuses a write, so every process already waits it out and
acknowledges nothing (runtime/redis_checks.py).

WAIT does not make Redis strongly consistent: a write that timed out is still on the primary
and may survive or not; a replica that confirmed a write can still lose it if it restarts without
persistence. What it gives is the property the failover test measures: no write a publisher or
the coordinator treated as acknowledged is missing after the confirmed replica is promoted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcp_saga.schemas.config import RedisSettings
from redis.exceptions import ResponseError


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
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)

    def check(self, acknowledged: Any, what: str = "write") -> None:
        """Raise NotReplicated unless WAIT's reply says enough replicas have the writes."""
        count = int(acknowledged)
        if count < self.replicas:
            raise NotReplicated(
                f"NOREPLICAS {what} confirmed by {count} of {self.replicas} replica(s) within "
                f"{self.timeout_ms} ms: not acknowledged"
            )
