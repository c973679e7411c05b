"""The coordinator process: read `saga:events` in a consumer group, fold, commit, dispatch, ack.

One batch flows through in a fixed order so that a crash at any point loses nothing and doubles
nothing: decode -> load views -> fold events (pure) -> commit (CAS Lua per workflow) -> enqueue
jobs (unique ids) -> follow-ups, dead letters and XACK in one pipeline. A batch that is
redelivered after a crash folds to no change, and its workflows' queued jobs are re-ensured.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from mcp_saga.coordinator.machine import Machine, Rejected, WorkflowView
from mcp_saga.coordinator.queue import enqueue, queue_for
from mcp_saga.coordinator.store import Store
from mcp_saga.runtime.failpoints import fail_point
from mcp_saga.runtime.logs import get_logger
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import Event, InvalidEvent, StepCompleted, decode_entry, stream_id
from mcp_saga.schemas.keys import DEAD_AT, DEAD_ID, DEAD_REASON, Keys
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = get_logger("coordinator")

Entry = tuple[bytes, dict[bytes, bytes]]
DeadEntry = tuple[bytes, dict[bytes, bytes], str]  # id, original fields, reason
Groups = dict[str, list[tuple[Event, dict[bytes, bytes]]]]
MAX_CONFLICT_RETRIES = 20
# Longest pause between attempts while Redis is unreachable (restart, failover, network).
MAX_OUTAGE_BACKOFF = 2.0


@dataclass
class BatchResult:
    events: int = 0
    dead: int = 0
    jobs: int = 0
    conflicts: int = 0
    statuses: dict[str, str] = field(default_factory=dict)


class Coordinator:
    def __init__(self, redis: Redis, config: Config, name: str | None = None) -> None:
        self.redis = redis
        self.config = config
        self.settings = config.coordinator
        self.keys = Keys(config.prefix)
        self.machine = Machine(config, prefix=config.prefix)
        self.store = Store(redis, self.keys, self.settings)
        self.queue = queue_for(redis, self.keys.queue)
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = False
        self._next_claim = 0.0
        self._next_watch = 0.0
        self._next_housekeeping = time.monotonic() + 10

    # Process lifetime ---------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the group from the stream's start, so events published before any coordinator count."""
        try:
            self.redis.xgroup_create(self.keys.events, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def stop(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        started, delay = False, 0.0
        while not self.stopping:
            try:
                if not started:
                    self.ensure_group()
                    log.info("coordinator started", consumer=self.name, stream=self.keys.events, group=self.keys.group)
                    # Our own pending entries first (a restart under the same name), then new ones.
                    self.process(self._read("0"), redelivered=True)
                    started = True
                self.step()
                delay = 0.0
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # A Redis restart must not end the process: a batch cut short is exactly a crash
                # mid-batch (its entries stay pending and are claimed again), so wait and go on.
                delay = min(MAX_OUTAGE_BACKOFF, delay * 2 or 0.05)
                log.warning("redis unreachable; retrying", error=str(exc), retry_in=delay)
                time.sleep(delay)
        log.info("coordinator stopped", consumer=self.name)
        return 0

    def step(self) -> BatchResult:
        """One turn of the loop: a claim or a read, then the watchdog and housekeeping when due."""
        now = time.monotonic()
        if now >= self._next_claim:
            self._next_claim = now + self.settings.claim_idle_ms / 2000
            claimed = self._claim()
            if claimed:
                return self.process(claimed, redelivered=True)
        result = self.process(self._read(">"), redelivered=False)
        if now >= self._next_watch:
            self._next_watch = now + self.settings.watchdog_every
            self.watch()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + 10
            self.housekeeping()
        return result

    def _read(self, start: str) -> list[Entry]:
        block = None if start == "0" else self.settings.block_ms
        reply = self.redis.xreadgroup(
            self.keys.group, self.name, {self.keys.events: start}, count=self.settings.batch, block=block
        )
        return [(i, f) for _, entries in reply for i, f in entries if f is not None] if reply else []

    def _claim(self) -> list[Entry]:
        """Take over entries another coordinator read but never acknowledged (it died)."""
        reply = self.redis.xautoclaim(
            self.keys.events,
            self.keys.group,
            self.name,
            min_idle_time=self.settings.claim_idle_ms,
            start_id="0-0",
            count=self.settings.batch,
        )
        entries = [(i, f) for i, f in reply[1] if f]
        if entries:
            log.warning("claimed pending events of a silent coordinator", count=len(entries))
        return entries

    # The batch ------------------------------------------------------------------------------

    def process(self, entries: list[Entry], *, redelivered: bool) -> BatchResult:
        result = BatchResult(events=len(entries))
        if not entries:
            return result
        now = time.time()
        groups, dead = self._decode(entries)
        created = self._record_fresh_steps(groups, now)
        committed, contended, conflicts = self._fold(groups, now, dead)
        fail_point("coordinator.after-commit")
        result.jobs = self._dispatch(committed, ensure=redelivered)
        unacked = {e.id for items in contended.values() for e, _ in items}
        ack = [i for i, _ in entries if i.decode() not in unacked]
        self.store.follow_up(
            committed,
            {v.workflow: self.machine.next_deadline(v) for v in committed if v.full},
            [self._index_created(created), self._dead_letters(dead), self._ack(ack)],
        )
        result.conflicts, result.dead = conflicts, len(dead)
        for view in committed:
            result.statuses[view.workflow] = view.state.status
            if view.state.status != view.loaded_status and view.loaded_status is not None:
                log.info(
                    "workflow status", workflow=view.workflow, status=view.state.status, attention=view.state.attention
                )
        for entry_id, _, reason in dead:
            log.warning("dead-lettered an event", id=entry_id.decode(), reason=reason)
        return result

    def _decode(self, entries: list[Entry]) -> tuple[Groups, list[DeadEntry]]:
        """Typed events grouped by workflow, in stream order; what breaks the contract aside."""
        groups: Groups = defaultdict(list)
        dead: list[DeadEntry] = []
        for entry_id, fields in entries:
            try:
                event = decode_entry(entry_id.decode(), fields)
            except InvalidEvent as exc:
                dead.append((entry_id, fields, str(exc)))
                continue
            groups[event.workflow].append((event, fields))
        return groups, dead

    def _fold(self, groups: Groups, now: float, dead: list[DeadEntry]) -> tuple[list[WorkflowView], Groups, int]:
        """Load, fold and commit each workflow, again for those another coordinator changed meanwhile.

        Returns the committed views, the groups still contended after the retries (left unacknowledged:
        they come back) and the number of conflicts met. Rejected events are added to `dead`.
        """
        committed: list[WorkflowView] = []
        pending, conflicts = dict(groups), 0
        for _ in range(MAX_CONFLICT_RETRIES):
            if not pending:
                break
            views = self._load(pending)
            rejected: dict[str, list[DeadEntry]] = defaultdict(list)
            for workflow, items in pending.items():
                for event, fields in items:
                    try:
                        self.machine.apply(views[workflow], event, now)
                    except Rejected as exc:
                        rejected[workflow].append((event.id.encode(), fields, str(exc)))
            dirty = [v for v in views.values() if v.dirty]
            lost = {
                v.workflow for v, ok in zip(dirty, self.store.commit(dirty) if dirty else [], strict=True) if not ok
            }
            conflicts += len(lost)
            for workflow, view in views.items():
                if workflow in lost:
                    continue
                dead.extend(rejected.get(workflow, ()))
                if view.state.version:  # else every event was rejected and the workflow does not exist
                    committed.append(view)
            pending = {w: pending[w] for w in lost}
        if pending:
            log.error("gave up on contended workflows this batch", workflows=sorted(pending))
        return committed, pending, conflicts

    def _record_fresh_steps(self, groups: Groups, now: float) -> list[str]:
        """The common case without a read: steps of running workflows, recorded by one script each.

        Removes what it recorded from `groups`; a workflow that turns out not to be running stays
        there for the compare-and-set path. Returns the workflows this created.
        """
        batches = {}
        for workflow, items in groups.items():
            if all(isinstance(e.data, StepCompleted) for e, _ in items):
                steps = []
                for event, _ in items:
                    comp, entries = self.machine.plan_step(workflow, event.data, 0, False, now, event.id)  # type: ignore[arg-type]
                    steps.append((comp, event.raw, entries))
                batches[workflow] = steps
        created = []
        for workflow, outcome in (self.store.record_steps(batches, now) if batches else {}).items():
            if outcome is not None:
                del groups[workflow]
                if outcome[0]:
                    created.append(workflow)
        return created

    def _index_created(self, workflows: list[str]) -> Callable:
        def add(pipe) -> None:  # type: ignore[no-untyped-def]
            if workflows:
                pipe.zadd(self.keys.index("running"), {w: time.time() for w in workflows})

        return add

    def _load(self, groups: Groups) -> dict[str, WorkflowView]:
        wanted = {}
        for workflow, items in groups.items():
            events = [e for e, _ in items]
            steps = [e.data.step for e in events if isinstance(e.data, StepCompleted)]
            wanted[workflow] = (self.machine.needs_full(events), steps)
        views = self.store.load(wanted)
        again = {w: (True, ()) for w, v in views.items() if not v.full and self.machine.needs_full([], v.state)}
        if again:
            views.update(self.store.load(again))
        return views

    def _dispatch(self, views: list[WorkflowView], *, ensure: bool) -> int:
        jobs = [job for view in views for job in view.jobs]
        if ensure:  # a redelivered batch: its first run may have committed but not enqueued
            known = {(j.workflow, j.step, j.dispatch) for j in jobs}
            for view in views:
                for comp in view.comps.values():
                    if comp.status == "queued" and (view.workflow, comp.step, comp.dispatch) not in known:
                        jobs.append(self.machine.job_for(view.workflow, comp))
        queued = 0
        for job in jobs:
            if enqueue(self.queue, job, self.config.worker):
                queued += 1
                log.info(
                    "dispatched compensation",
                    workflow=job.workflow,
                    step=job.step,
                    server=job.server,
                    operation=job.operation_id,
                    dispatch=job.dispatch,
                )
        return queued

    def _dead_letters(self, dead: list[DeadEntry]) -> Callable:
        def add(pipe) -> None:  # type: ignore[no-untyped-def]
            for entry_id, fields, reason in dead:
                # Original fields kept under their own names; ours prefixed so they never collide.
                record = {DEAD_REASON: reason.encode(), DEAD_ID: entry_id, DEAD_AT: f"{time.time():.3f}"}
                record.update({k: v for k, v in fields.items() if not k.startswith(b"dead.")})
                pipe.xadd(self.keys.dead_letter, record, maxlen=self.settings.dead_letter_maxlen, approximate=True)

        return add

    def _ack(self, ids: list[bytes]) -> Callable:
        def ack(pipe) -> None:  # type: ignore[no-untyped-def]
            if ids:
                pipe.xack(self.keys.events, self.keys.group, *ids)

        return ack

    # Watchdog and housekeeping ------------------------------------------------------------

    def watch(self) -> int:
        """Look at workflows whose barrier or dispatch deadline passed."""
        now = time.time()
        due = self.store.due(now)
        if not due:
            return 0
        views = self.store.load({w: (True, ()) for w in due})
        live = []
        for workflow, view in views.items():
            if not view.state.version:
                self.redis.zrem(self.keys.deadlines, workflow)
                continue
            self.machine.tick(view, now)
            live.append(view)
        dirty = [v for v in live if v.dirty]
        oks = self.store.commit(dirty) if dirty else []
        lost = {v.workflow for v, ok in zip(dirty, oks, strict=True) if not ok}
        committed = [v for v in live if v.workflow not in lost]
        self._dispatch(committed, ensure=False)
        self.store.follow_up(committed, {v.workflow: self.machine.next_deadline(v) for v in committed}, [])
        return len(committed)

    def housekeeping(self) -> None:
        removed = self.store.collect_garbage()
        trimmed = self.trim_events()
        if removed or trimmed:
            log.info("housekeeping", index_entries_removed=removed, events_trimmed=trimmed)

    def trim_events(self) -> int:
        """Trim `saga:events` below the oldest entry some consumer group still needs."""
        try:
            groups = self.redis.xinfo_groups(self.keys.events)
        except ResponseError:
            return 0
        floor: list[str] = []
        for group in groups:
            name = group["name"]
            # Another coordinator may ack the last pending entries between the two reads: then there
            # is no oldest one, and the delivered position read above is still a safe floor.
            oldest = self.redis.xpending(self.keys.events, name)["min"] if group["pending"] else None
            if oldest is not None:
                floor.append(oldest.decode() if isinstance(oldest, bytes) else oldest)
            else:
                last = group["last-delivered-id"]
                floor.append(_next_id(last.decode() if isinstance(last, bytes) else last))
        if not floor:
            return 0
        return self.redis.xtrim(self.keys.events, minid=min(floor, key=stream_id), approximate=False)


def _next_id(entry_id: str) -> str:
    ms, seq = stream_id(entry_id)
    return f"{ms}-{seq + 1}"
