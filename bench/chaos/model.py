"""What a chaos run is given (Settings) and what it finds (Report), and the example servers' vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SERVERS = ("inventory", "payments", "shipping")
# tool -> (server, field of the result naming the holding it created, status it creates)
FORWARD = {
    "reserve_inventory": ("inventory", "reservationId", "active"),
    "charge_payment": ("payments", "transactionId", "charged"),
    "create_shipment": ("shipping", "shipmentId", "created"),
}
# server -> (compensating tool, the status a holding has once undone)
UNDO = {"inventory": ("release_inventory", "released"), "payments": ("refund_payment", "refunded"),
        "shipping": ("cancel_shipment", "cancelled")}  # fmt: skip
UNDO_TOOLS = {tool for tool, _ in UNDO.values()}
TERMINAL = ("completed", "compensated", "needs-attention")
Out = Callable[[str], None]


@dataclass
class Settings:
    """One chaos run. The defaults are the full run; `Settings.reduced()` is the test suite's."""

    workflows: int = 500
    publishers: int = 4
    concurrency: int = 5  # workflows in flight per publisher
    coordinators: int = 2
    workers: int = 3
    kills: int = 5  # SIGKILLs of coordinators, and as many of workers
    server_restarts: int = 1
    redis_restarts: int = 1
    crashes_after_call: int = 2  # extra workers that die between a compensation call and its report
    stalls: int = 2  # SIGSTOPs of coordinators (resumed later), and as many of workers mid-call
    stall_seconds: float = 6.0  # longer than claim_idle_ms and the lease: claims and the watchdog step in
    blackholes: int = 1  # SIGSTOPs of an example server (for stall_seconds): its calls hang
    fills: int = 1  # times Redis's maxmemory is set just above its use (noeviction: writes fail with OOM)
    full_seconds: float = 3.0  # how long Redis stays full each time
    full_margin: int = 8 * 1024  # bytes of maxmemory above used_memory while full
    wipes: int = 1  # restarts of redis-server without its data (append-only file deleted)
    # On a local Redis Cluster (3 primaries, a replica each; RQ's queue on a standalone Redis) instead
    # of one redis-server: the Redis faults above do not apply there, a primary's SIGKILL does.
    redis_cluster: bool = False
    partitions: int = 3  # [redis] partitions, on a cluster
    primary_kills: int = 0  # SIGKILLs of a cluster primary (its replica takes over; not restarted)
    min_steps: int = 3
    max_steps: int = 5
    fail_share: float = 0.4  # share of workflows that fail, at a random step
    fail_rate: float = 0.2  # share of compensation calls the servers fail transiently
    # Share of failing workflows that fail on a forward call whose answer the agent never gets: it
    # gives up after `lost_answer_after` s while the server runs the call (issue 14's in-doubt steps).
    lost_share: float = 0.25
    lost_answer_after: float = 0.002
    # mcp-saga's own timeouts, short so that the watchdog, claims and leases all get exercised.
    watchdog_after: float = 4.0
    claim_idle_ms: int = 1000
    barrier_grace: float = 5.0
    lease: float = 4.0
    call_timeout: float = 3.0  # a worker's timeout per compensation call (below the lease)
    attempts: int = 6
    backoff_base: float = 0.5
    backoff_max: float = 2.0
    job_timeout: int = 15
    retention: int = 15  # seconds a settled workflow stays in Redis (short, so expiry can be watched)
    idle_ttl: int = 300
    in_doubt_after: float = 120.0  # a running workflow with an open call and no event is failed after this
    publisher_call_timeout: float = 15.0
    refused_pause: float = 1.0  # a publisher's pause after a workflow whose write Redis refused (a full Redis)
    publish_timeout: float = 600.0  # bounded wait for the publishers
    settle_timeout: float = 180.0  # bounded wait for quiescence after the publishers finished
    expiry_timeout: float = 90.0  # bounded wait for keys to expire after quiescence
    memory_slack: int = 128 * 1024  # data bytes outside keys still called "back to baseline" (verify.memory_overrun)
    seed: int | None = None
    workdir: str | None = None
    keep: bool = False

    @classmethod
    def reduced(cls, **overrides: Any) -> Settings:
        """The test suite's run: every kind of fault at least twice, well under a minute and a half."""
        base = dict(workflows=64, publishers=2, concurrency=4, workers=2, kills=2, retention=6, expiry_timeout=60)
        return cls(**{**base, **overrides})

    @classmethod
    def reduced_cluster(cls, **overrides: Any) -> Settings:
        """The reduced run on a local Redis Cluster: the primary holding a partition's stream is
        SIGKILLed mid-run, instead of the one Redis's restarts, fill and wipe.

        Retention is the full run's 15 s: an entry held by a killed coordinator waits for the failover
        (about 3 s here) on top of its claim, and a step handled after its completed workflow expired
        starts a new one (README, "Not promised"); 6 s let that happen in one run of three.
        """
        base = dict(redis_cluster=True, primary_kills=1, redis_restarts=0, fills=0, wipes=0, retention=15)
        return cls.reduced(**{**base, **overrides})


@dataclass
class Report:
    """What the run did and found; `violations` is empty when every guarantee held."""

    workflows: int = 0
    completed: int = 0
    failed: int = 0
    steps: int = 0
    compensations: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    coordinator_kills: int = 0
    worker_kills: int = 0
    worker_kills_mid_job: int = 0
    server_restarts: int = 0
    redis_restarts: int = 0
    coordinator_stalls: int = 0
    server_blackholes: int = 0
    redis_fills: int = 0
    redis_full_seconds: float = 0.0  # the longest time a fill really held Redis full (its window: full_seconds)
    stall_seconds: float = 0.0  # the longest a SIGSTOP really lasted (stall_seconds) before its SIGCONT
    oom_refusals: int = 0
    redis_wipes: int = 0
    primary_kills: int = 0  # cluster primaries SIGKILLed (their replicas took over)
    failover_seconds: float = 0.0  # longest time from a primary's SIGKILL to a healthy cluster
    failover_lost: int = 0  # acknowledged events the promoted replica did not have (counted, see verify)
    failover_notes: list[str] = field(default_factory=list)  # what each of those workflows misses
    wiped_workflows: int = 0  # in flight when Redis lost its data: lost, and counted as such
    wiped_effects: int = 0  # their committed effects left in place (Redis no longer knew of them)
    worker_stalls: int = 0
    unexpected_exits: int = 0
    injected_errors: int = 0
    transport_errors: int = 0  # compensation calls that got no answer (the server restart)
    answers_lost: int = 0  # forward calls the agents gave up on after `lost_answer_after` (injected)
    dispatches: int = 0
    redispatches: int = 0
    crashes_after_call: int = 0
    crash_repeats: int = 0  # of those, compensations whose call had taken effect and was made again
    repeat_calls: int = 0  # compensation calls that reached a server again for an already-applied key
    duplicate_jobs_stopped: int = 0  # job runs that a worker skipped (already settled, stale, leased)
    double_effects: int = 0
    lost_events: int = 0
    out_of_order: int = 0  # failed workflows whose undos were not applied last-first
    late_steps: int = 0  # steps of completed workflows handled after their completion
    # Those by their stream entry against the completion's (verify.late_order): "before" (folded
    # out of stream order), "after" (the step reached the stream later), "unknown".
    late_order: dict[str, int] = field(default_factory=dict)
    # Workflows events started again after they expired (held by a coordinator paused or dead for
    # longer than the retention: README, "Not promised"), and the published steps only those have.
    restarted_workflows: int = 0
    restarted_steps: int = 0
    left_for_human: int = 0  # committed effects of needs-attention workflows, not undone, with a reason
    unseen_effects: int = 0  # effects a server applied but no orchestrator learned of, and no intent records
    # Effects that landed but were never confirmed to the orchestrator, whose intent mcp-saga recorded:
    in_doubt_undone: int = 0  # undone in the unwind (a recall, or a compensation bound from the request)
    in_doubt_flagged: int = 0  # left in place in a needs-attention workflow, with the in-doubt reason
    in_doubt_lost: int = 0  # in workflows lost with Redis's data, or whose orchestrator never signalled
    attention: dict[str, str] = field(default_factory=dict)
    dead_letters: dict[str, int] = field(default_factory=dict)
    workflow_keys_after: int = -1
    memory_detail: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory_before: int = 0
    memory_after: int = 0
    rq_bytes_after: int = 0
    memory_peak: int = 0  # Redis's used_memory_peak over the run (its server is the run's own)
    events_added: int = 0  # events published: steps and terminal events of the records, workers' reports
    publish_seconds: float = 0.0  # from the first publisher's start to the last one's end
    settle_seconds: float = 0.0
    wall_seconds: float = 0.0
    seed: int = 0
    workdir: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def rows(self) -> list[tuple[str, str]]:
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items()))
        return [
            ("workflows", f"{self.workflows} ({self.completed} completed, {self.failed} failed: {statuses})"),
            ("steps", str(self.steps)),
            ("compensations", f"{self.compensations} ({self.dispatches} dispatched, {self.redispatches} again)"),
            (
                "kills survived",
                f"{self.coordinator_kills} coordinator, {self.worker_kills} worker "
                f"({self.worker_kills_mid_job} mid-job), SIGKILL; {self.crashes_after_call} workers died "
                "between a call and its report",
            ),
            (
                "stalls survived",
                f"{self.coordinator_stalls} coordinator, {self.worker_stalls} worker (mid-call when one was busy), "
                f"SIGSTOP then SIGCONT (after {self.stall_seconds:.1f} s at most)",
            ),
            ("server restarts", f"{self.server_restarts} (+ {self.server_blackholes} black-holed: calls hang)"),
            ("redis restarts", f"{self.redis_restarts} (append-only file on)"),
            *(
                [
                    (
                        "cluster primaries killed",
                        f"{self.primary_kills} (SIGKILL; healthy again after {self.failover_seconds:.1f} s): "
                        f"{self.failover_lost} acknowledged events lost with it",
                    )
                ]
                if self.primary_kills
                else []
            ),
            (
                "redis full",
                f"{self.redis_fills} (maxmemory just above use, noeviction, "
                f"for {self.redis_full_seconds:.1f} s at most): {self.oom_refusals} commands refused with OOM",
            ),
            (
                "redis data lost",
                f"{self.redis_wipes} (restarted without its append-only file): {self.wiped_workflows} workflows "
                f"in flight lost, {self.wiped_effects} of their effects left in place",
            ),
            (
                "injected errors",
                f"{self.injected_errors} (+ {self.transport_errors} calls with no answer while a server restarted; "
                f"{self.answers_lost} forward calls whose agent gave up on the answer)",
            ),
            (
                "repeats absorbed",
                f"{self.repeat_calls} calls by the idempotency key ({self.crash_repeats} after a worker died between "
                f"call and report), {self.duplicate_jobs_stopped} job runs by the record or lease",
            ),
            ("double effects", str(self.double_effects)),
            ("out of LIFO order", str(self.out_of_order)),
            ("lost events", self.lost_events_text()),
            ("needs-attention", f"{len(self.attention)} workflows, {self.left_for_human} effects left with a reason"),
            (
                "landed, never confirmed",
                f"{self.in_doubt_undone + self.in_doubt_flagged + self.in_doubt_lost} effects whose call the "
                f"orchestrator saw fail: {self.in_doubt_undone} undone, {self.in_doubt_flagged} needs-attention "
                f"(in doubt), {self.in_doubt_lost} in workflows lost or never signalled",
            ),
            (
                "effects no one published",
                f"{self.unseen_effects} (a call the orchestrator saw fail but the server ran)",
            ),
            ("keys after expiry", f"{self.workflow_keys_after} per-workflow keys"),
            ("redis memory", self.memory_text()),
            ("wall time", f"{self.wall_seconds:.0f} s (quiescent {self.settle_seconds:.0f} s after the last workflow)"),
        ]

    def memory_text(self) -> str:
        """Before and after, and what the after is made of: data (RQ's records, our kept keys) and the rest by name."""
        text = f"{self.memory_before / 1e6:.2f} MB before, {self.memory_after / 1e6:.2f} MB after"
        before, after = self.memory_detail.get("before"), self.memory_detail.get("after")
        if not before or "data" not in after:
            return f"{text} ({self.rq_bytes_after / 1e6:.2f} MB of it RQ job records)"
        kept = ", ".join(f"{name} {size / 1e3:.0f} kB" for name, size in after["ours"].items() if size >= 1000)
        return (
            f"{text}: data {before['data'] / 1e6:.2f} -> {after['data'] / 1e6:.2f} MB, of it "
            f"{after['rq_bytes'] / 1e6:.2f} MB RQ job records and {after['saga_bytes'] / 1e3:.0f} kB mcp-saga's "
            f"kept keys ({kept}); not data: {after['connections']} connections {after['clients'] / 1e6:.2f} MB, "
            f"scripts {after['scripts'] / 1e3:.0f} kB, server overhead {after['overhead'] / 1e6:.2f} MB"
        )

    def lost_events_text(self) -> str:
        notes = self.late_notes()
        return f"{self.lost_events} ({'; '.join(notes)})" if notes else str(self.lost_events)

    def late_notes(self) -> list[str]:
        """What the "lost events" row explains: events handled late, none of them lost."""
        notes = []
        if self.late_steps:
            where = ", ".join(f"{n} {order} it in the stream" for order, n in sorted(self.late_order.items()))
            notes.append(
                f"{self.late_steps} steps of completed workflows were recorded after the completion "
                f"({where or 'stream order unknown'}: nothing to undo)"
            )
        if self.restarted_workflows:
            notes.append(
                f"{self.restarted_workflows} workflows restarted by events handled after their retention, "
                f"{self.restarted_steps} published steps recorded only there"
            )
        return notes

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'':{width}} | chaos run |", f"| {'-' * width} | --- |"]
        lines += [f"| {k:{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)
