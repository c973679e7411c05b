"""Every Redis key name mcp-saga reads or writes, built in one place.

Per-workflow keys carry the workflow id in a hash tag (`saga:{order-42}:state`) so that one
workflow lives in one Redis Cluster slot and a Lua script can declare all the keys it touches.
Global keys (streams, indexes) never share a script with per-workflow keys. The status indexes,
the watchdog's deadlines and the index versions share one hash tag of their own (`{idx}`), so the
script that moves a workflow between indexes touches one slot too. The tag sits after a plain
`index:` so that `workflow_pattern` (`saga:{*}:*`) never matches these keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcp_saga.schemas.records import WORKFLOW_STATUSES

# Fields a dead-letter entry adds beside the original entry's own (prefixed so they never collide).
DEAD_REASON, DEAD_ID, DEAD_AT = "dead.reason", "dead.id", "dead.at"

STATUSES = WORKFLOW_STATUSES  # one index per workflow status


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "saga"

    # Global streams and indexes.
    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}:dead-letter"

    @property
    def outcomes(self) -> str:
        return f"{self.prefix}:outcomes"

    def index(self, status: str) -> str:
        """Sorted set of workflow ids in one status, scored by the time they entered it."""
        return f"{self.prefix}:index:{{idx}}:{status}"

    @property
    def deadlines(self) -> str:
        """Sorted set of workflow ids scored by when the watchdog must look at them next."""
        return f"{self.prefix}:index:{{idx}}:deadlines"

    @property
    def index_versions(self) -> str:
        """Hash workflow id -> `createdAt:version` of the state the indexes last reflected, so a
        late follow-up of an older transition never moves a workflow back (see index.lua)."""
        return f"{self.prefix}:index:{{idx}}:versions"

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
