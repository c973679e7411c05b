"""Every Redis key name mcp-saga reads or writes, built in one place.

Per-workflow keys carry the workflow id in a hash tag (`saga:{order-42}:state`) so that one
workflow lives in one Redis Cluster slot and a Lua script can declare all the keys it touches.
Global keys (streams, indexes) never share a script with per-workflow keys. The status indexes,
the watchdog's deadlines and the index versions share one hash tag of their own (`{idx}`), so the
script that moves a workflow between indexes touches one slot too. The tag sits after a plain
`index:` so that `workflow_pattern` (`saga:{*}:*`) never matches these keys.

Partitions (for Redis Cluster, where one XREADGROUP cannot span slots): the events, dead-letter
and outcomes streams and the indexes exist once per partition, and a workflow belongs to the
partition `partition_of` names: Redis's own key slot of the workflow id (CRC16 mod 16384, what
`redis-cli CLUSTER KEYSLOT order-42` prints and every cluster client computes) modulo the count.
A partition's keys share the hash tag `{part-N}` (`saga:events:{part-2}`, `saga:index:{part-2}:
running`), so each partition's scripts touch one slot, and its keys sit on one node. With one
partition (the default) there is no tag: the names are the ones every release before used, so a
standalone deployment needs no migration. The tag family `part-N` was picked because partitions
0, 1 and 2 fall in different thirds of the slot space: one per primary of a cluster created with
`redis-cli --cluster create` on three primaries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mcp_saga.schemas.records import WORKFLOW_STATUSES
from redis import crc

# Fields a dead-letter entry adds beside the original entry's own (prefixed so they never collide).
DEAD_REASON, DEAD_ID, DEAD_AT = "dead.reason", "dead.id", "dead.at"

STATUSES = WORKFLOW_STATUSES  # one index per workflow status
SLOTS = 16384  # Redis Cluster's slot count: the routing rule's first modulus
MAX_PARTITIONS = 1024


def key_slot(key: str) -> int:
    """The cluster slot of a key, hash tags included: `key_slot("order-42")` == `CLUSTER KEYSLOT order-42`.

    redis-py's own implementation (CRC16-XModem mod 16384, the cluster spec's), so the rule is the
    one every cluster client routes by.
    """
    return crc.key_slot(key.encode(), SLOTS)


class PartitionUnbound(LookupError):
    """A partitioned key was asked for without saying which partition (a bug, not an operator mistake)."""


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "saga"
    # How many partitions the streams and indexes are split into (fixed for a deployment).
    partitions: int = 1
    # The partition the stream and index names below are of; None: not bound (fine with one).
    part: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, not {self.partitions}")
        if self.part is not None and not 0 <= self.part < self.partitions:
            raise ValueError(f"partition {self.part} is not one of 0..{self.partitions - 1}")

    # Partitions.
    def partition_of(self, workflow: str) -> int:
        """THE routing rule: `CLUSTER KEYSLOT <workflow>` modulo the partition count."""
        return key_slot(workflow) % self.partitions if self.partitions > 1 else 0

    def on(self, part: int) -> Keys:
        """These keys with the stream and index names of partition `part`."""
        return replace(self, part=part)

    def route(self, workflow: str) -> Keys:
        """These keys bound to the partition that `workflow` belongs to."""
        return self.on(self.partition_of(workflow))

    def every(self) -> list[Keys]:
        """One bound copy per partition, in partition order: what readers that gather iterate."""
        return [self.on(p) for p in range(self.partitions)]

    @property
    def tag(self) -> str:
        """The hash tag of the bound partition's keys (`{part-2}`); `{idx}` for one partition."""
        if self.partitions == 1:
            return "{idx}"
        if self.part is None:
            raise PartitionUnbound(f"{self.partitions} partitions: say which (Keys.on(n) or Keys.route(workflow))")
        return f"{{part-{self.part}}}"

    def _streamed(self, name: str) -> str:
        return f"{self.prefix}:{name}" if self.partitions == 1 else f"{self.prefix}:{name}:{self.tag}"

    @property
    def layout(self) -> str:
        """The partition count the data was written with, so that processes configured otherwise refuse to run."""
        return f"{self.prefix}:partitions"

    # Streams and indexes, per partition.
    @property
    def events(self) -> str:
        return self._streamed("events")

    @property
    def dead_letter(self) -> str:
        return self._streamed("dead-letter")

    @property
    def outcomes(self) -> str:
        return self._streamed("outcomes")

    def index(self, status: str) -> str:
        """Sorted set of workflow ids in one status, scored by the time they entered it."""
        return f"{self.prefix}:index:{self.tag}:{status}"

    @property
    def deadlines(self) -> str:
        """Sorted set of workflow ids scored by when the watchdog must look at them next."""
        return f"{self.prefix}:index:{self.tag}:deadlines"

    @property
    def index_versions(self) -> str:
        """Hash workflow id -> `createdAt:version` of the state the indexes last reflected, so a
        late follow-up of an older transition never moves a workflow back (see index.lua)."""
        return f"{self.prefix}:index:{self.tag}:versions"

    def index_keys(self) -> list[str]:
        """The keys index.lua declares, in its order: versions, deadlines, then one per status."""
        return [self.index_versions, self.deadlines, *(self.index(s) for s in STATUSES)]

    @property
    def metrics_reader(self) -> str:
        """Which process reads the fleet-wide gauges for Prometheus (a short lease, see runtime/metrics.py)."""
        return f"{self.prefix}:metrics:reader"

    @property
    def group(self) -> str:
        """The consumer group every coordinator joins on the events stream."""
        return "coordinators"

    @property
    def queue(self) -> str:
        """The RQ queue name (RQ prefixes it with `rq:queue:` itself)."""
        return self.prefix

    # Per-workflow keys.
    def state(self, workflow: str) -> str:
        return f"{self.prefix}:{{{workflow}}}:state"

    def steps(self, workflow: str) -> str:
        return f"{self.prefix}:{{{workflow}}}:steps"

    def comp(self, workflow: str) -> str:
        return f"{self.prefix}:{{{workflow}}}:comp"

    def log(self, workflow: str) -> str:
        return f"{self.prefix}:{{{workflow}}}:log"

    def lease(self, workflow: str, step: str) -> str:
        """A worker's short claim on one compensation, so two workers never run it at once."""
        return f"{self.prefix}:{{{workflow}}}:lease:{step}"

    def outbox(self, workflow: str) -> str:
        """List of a transition's outcomes, written by its script and moved to `outcomes` after it,
        so that a crash in between delays them instead of losing them."""
        return f"{self.prefix}:{{{workflow}}}:outbox"

    def workflow_keys(self, workflow: str) -> tuple[str, str, str, str, str]:
        """The keys a transition script declares, in the order the scripts expect them."""
        return (
            self.state(workflow),
            self.steps(workflow),
            self.comp(workflow),
            self.log(workflow),
            self.outbox(workflow),
        )

    def workflow_pattern(self) -> str:
        return f"{self.prefix}:{{*}}:*"
