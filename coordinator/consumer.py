"""The coordinator process: read `saga:events` in a consumer group, fold, commit, dispatch, ack.

One batch flows through in a fixed order so that a crash at any point loses nothing and doubles
nothing: decode -> load views -> fold events (pure) -> commit (CAS Lua per workflow) -> enqueue
jobs (unique ids; on one Redis in the commit's round trip, see Store.commit) -> follow-ups, dead
letters and XACK in one pipeline. A batch that is
redelivered after a crash folds to no change, and its workflows' queued jobs are re-ensured.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mcp_saga.coordinator.machine import Machine, Rejected, WorkflowView
from mcp_saga.coordinator.queue import enqueue_all, queue_for
from mcp_saga.coordinator.store import DeadEntry, IndexItem, Recorded, Store, gone_item, index_item
from mcp_saga.runtime import metrics, tracing
from mcp_saga.runtime.connect import check_layout
from mcp_saga.runtime.durability import Durability
from mcp_saga.runtime.failpoints import fail_point
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.redis_checks import MAX_REFUSAL_BACKOFF, RateLimitedLog, check_redis, healing_condition
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import Event, InvalidEvent, StepCompleted, StepStarted, decode_entry, stream_id
from mcp_saga.schemas.keys import STATUSES
from mcp_saga.schemas.records import Compensation, job_id_for
from mcp_saga.schemas.timeline import TimelineEntry
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = get_logger("coordinator")

Entry = tuple[bytes, dict[bytes, bytes]]
Groups = dict[str, list[tuple[Event, dict[bytes, bytes]]]]
Planned = dict[str, tuple[int, list[tuple[Compensation, bytes, list[TimelineEntry]]]]]
MAX_CONFLICT_RETRIES = 20
# Longest pause between attempts while Redis is unreachable (restart, failover, network).
MAX_OUTAGE_BACKOFF = 2.0
# Workflows whose step count a coordinator remembers for the fast path (see _record_fresh_steps).
STEP_COUNT_CACHE = 100_000


# Error prefixes of conditions that heal by themselves or by an operator's hand, with no restart.
# How Redis (6.2, 7.0) reports an error a script's redis.call raised: the inner error's prefix after
# a dash, behind "Command # N (EVALSHA ...) of pipeline caused error: " when it ran in a pipeline.


@dataclass
class BatchResult:
    events: int = 0
    dead: int = 0
    jobs: int = 0
    conflicts: int = 0
    statuses: dict[str, str] = field(default_factory=dict)


@dataclass
class Batch:
    """One batch between its read and its acknowledgement."""

    entries: list[Entry]
    redelivered: bool
    started: float
    now: float
    groups: Groups
    dead: list[DeadEntry]
    traces: tracing.BatchTraces
    # The watchdog deadline of each workflow with an intent in the batch, at which an unsettled one
    # makes it abandoned (Machine.idle_due): the watchdog's look then finds it settled, or fails it.
    deadlines: dict[str, str] = field(default_factory=dict)
    # The fast path's plans: workflow -> (the step count they are numbered from, the planned steps).
    planned: Planned = field(default_factory=dict)
    held: frozenset[str] = frozenset()


class Coordinator:
    """Consumes one partition's events stream (the only one, unless `[redis] partitions` says more).

    `queue` is the RQ queue's Redis when it is not `redis` (always so on a cluster).
    """

    def __init__(
        self, redis: Redis, config: Config, name: str | None = None, *, partition: int = 0, queue: Redis | None = None
    ) -> None:
        self.redis = redis
        self.config = config
        self.settings = config.coordinator
        self.keys = config.keys().on(partition)
        self.machine = Machine(config, prefix=config.prefix)
        self.queue = queue_for(redis if queue is None else queue, self.keys.queue)
        self.store = Store(
            redis,
            self.keys,
            self.settings,
            durability=Durability.of(config.redis),
            queue=self.queue,
            worker=config.worker,
        )
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = False
        self._next_claim = 0.0
        self._next_watch = 0.0
        self._next_housekeeping = time.monotonic() + 10
        self._refused = RateLimitedLog(log)
        self._step_counts: dict[str, int] = {}
        # A batch read ahead and planned, to be committed by the next step; entries read behind a
        # commit, to be planned during the next one; and the acknowledgements that go with the next
        # write (see _overlapped).
        self._ready: Batch | None = None
        self._unread: list[Entry] = []
        self._settles: list[tuple[Any, ...]] = []

    # Process lifetime ---------------------------------------------------------------------

    def ensure_group(self) -> None:
        """Create the group from the stream's start, so events published before any coordinator count.

        Looked up first: creating is a write, which a Redis out of memory refuses even when the
        group exists, and a coordinator must be able to start (and wait) under OOM.
        """
        try:
            if any(
                g["name"] in (self.keys.group, self.keys.group.encode())
                for g in self.redis.xinfo_groups(self.keys.events)
            ):
                return
        except ResponseError:  # no stream yet
            pass
        try:
            self.redis.xgroup_create(self.keys.events, self.keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def stop(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():  # else coordinator/partitions.py stops us
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        started, delay = False, 0.0
        checked = False
        while not self.stopping:
            try:
                if not checked:
                    check_redis(self.redis, allow_eviction=self.config.redis.allow_eviction, log=log)
                    for warning in self.config.warnings():
                        log.warning("config trade-off", detail=warning)
                    checked = True
                if not started:
                    check_layout(self.redis, self.keys)
                    self.ensure_group()
                    log.info("coordinator started", consumer=self.name, stream=self.keys.events, group=self.keys.group)
                    # Our own pending entries first (a restart under the same name, or a batch
                    # Redis refused half-way), then new ones.
                    self.process(self._read("0"), redelivered=True)
                    started = True
                self.step()
                if delay:
                    metrics.REDIS_RECONNECTS.labels("coordinator").inc()
                delay = 0.0
            except (RedisConnectionError, RedisTimeoutError) as exc:
                self._forget_ahead()  # its entries stay pending, as a batch cut short: they are claimed again
                metrics.REDIS_ERRORS.labels("coordinator").inc()
                # A Redis restart must not end the process: a batch cut short is exactly a crash
                # mid-batch (its entries stay pending and are claimed again), so wait and go on.
                delay = min(MAX_OUTAGE_BACKOFF, delay * 2 or 0.05)
                log.warning("redis unreachable; retrying", error=str(exc), retry_in=delay)
                time.sleep(delay)
            except NoScriptError:
                # A Redis that lost its scripts refused a commit sent by digest, which ran nothing of
                # that workflow's; the batch may be half-committed, as after a crash between two
                # writes: its entries are read again with our pending ones, and their jobs re-ensured.
                self._forget_ahead()
                self.store.load_scripts()
                started = False
                log.warning("redis lost its scripts; loaded them again, re-reading the pending events")
            except ResponseError as exc:
                self._forget_ahead()  # read again with the rest of our pending entries
                condition = healing_condition(exc)
                if condition is None:
                    raise
                # Nothing of the batch was acknowledged: it is read again (own pending, "0") once
                # Redis accepts writes. The log says so at most every few seconds.
                started = False
                delay = min(MAX_REFUSAL_BACKOFF, delay * 2 or 0.1)
                if condition == "NOGROUP":
                    self._group_vanished()
                else:
                    self._refused.note(condition, str(exc), delay)
                time.sleep(delay)
        try:
            self.drain()  # what was read ahead; left pending if Redis is gone, and claimed again
        except (RedisConnectionError, RedisTimeoutError, ResponseError) as exc:
            log.warning("stopped with a batch read but not handled; it will be claimed again", error=str(exc))
        log.info("coordinator stopped", consumer=self.name)
        return 0

    def _forget_ahead(self) -> None:
        """Drop what was read ahead and the acknowledgements owed: the entries stay pending, and
        come back (claimed, or read again with our pending entries) to be folded, idempotently."""
        self._ready, self._unread, self._settles = None, [], []

    def _group_vanished(self) -> None:
        """Say loudly what was lost when the group disappeared (flushed, evicted, deleted)."""
        try:
            length = self.redis.xlen(self.keys.events)
            workflows = sum(self.redis.zcard(self.keys.index(s)) for s in STATUSES)
        except ResponseError:
            length, workflows = -1, -1
        log.error(
            "the consumer group vanished: DATA WAS LOST (flushed, evicted or deleted). Events not yet "
            "handled are gone unless still in the stream, which the re-created group reads from its start",
            stream=self.keys.events,
            group=self.keys.group,
            entries_left=length,
            workflows_indexed=workflows,
        )

    def step(self) -> BatchResult:
        """One turn of the loop: a claim or a read, then the watchdog and housekeeping when due."""
        now = time.monotonic()
        metrics.heartbeat()
        if now >= self._next_claim:
            self._next_claim = now + self.settings.claim_idle_ms / 2000
            claimed = self._claim()
            if claimed:
                self.drain()
                return self.process(claimed, redelivered=True)
        result = self._overlapped() if self.store.overlaps else self.process(self._read(">"), redelivered=False)
        if now >= self._next_watch:
            self._next_watch = now + self.settings.watchdog_every
            if self._ready is None and not self._unread:  # idle: what the watchdog reads as pending is
                self._settle_now()  # not what a finished batch still owes an acknowledgement for
            self.watch()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + 10
            self.housekeeping()
        return result

    def _overlapped(self) -> BatchResult:
        """One batch, its commit overlapped with planning the next (one Redis, no WAIT).

        Each batch's commit goes out in one write with a read behind it, and the next batch, read
        by the write before, is decoded and planned while Redis runs the commit; by the time this
        batch is finished the read behind it is answered, so this process never waits for a read
        while there is work. The acknowledgement of a finished batch rides with the next write
        (or goes at once when nothing else is in hand). So an entry is acknowledged only after
        its commit and its follow-ups, and a workflow of both batches is planned only once this
        one's outcome is known (`held`). The next batch waits, read and planned, for the next call.

        A batch a blocking read found short of `batch` entries (an idle stream: a failure, a
        report) reads nothing ahead: its events were the whole stream a moment ago, and a read
        ahead of its load would only put a round trip between the failure and its compensation.
        Its acknowledgement rides with the next blocking read (`_straight`).
        """
        batch, self._ready = self._ready, None
        if batch is None:
            entries, self._unread = self._unread, []
            if not entries:
                entries = self._read_settling()
                if not entries:
                    return BatchResult()
                if len(entries) < self.settings.batch:
                    return self._straight(self._prepare(entries, redelivered=False))
            batch = self._prepare(entries, redelivered=False)
        self._plan_held(batch)
        k = self.keys
        read = ("XREADGROUP", "GROUP", k.group, self.name, "COUNT", self.settings.batch, "STREAMS", k.events, ">")
        following, self._unread = self._unread, []
        # Nothing read yet to plan beside this commit (a burst starts): read it ahead of the commit.
        ahead = None if following else read
        settles, self._settles = self._settles, []
        reply, flight = self.store.record_ahead(ahead, batch.planned, batch.now, [read, *settles], batch.deadlines)
        try:
            try:
                if ahead is not None:
                    following = _entries(reply)
                held = frozenset(batch.groups)
                upcoming = self._prepare(following, redelivered=False, held=held) if following else None
            finally:
                outcomes = self.store.collect(flight)
            result = self._finish(batch, outcomes, defer=True)
        except BaseException:
            self.store.discard(flight)  # the replies behind are not read: the connection goes
            raise
        self._unread = _entries(self.store.read_trail(flight)[0])
        self._ready = upcoming
        if upcoming is None and not self._unread:
            self._settle_now()  # a burst ended: what it owes goes out before the wait for more
        return result

    def _straight(self, batch: Batch) -> BatchResult:
        """A batch of an idle stream: its fast path's record, then load, commit and dispatch at once."""
        outcomes: dict[str, Recorded | None] = {}
        if batch.planned:
            _, flight = self.store.record_ahead(None, batch.planned, batch.now, deadlines=batch.deadlines)
            outcomes = self.store.collect(flight)
        return self._finish(batch, outcomes, defer=True)

    def _read_settling(self) -> list[Entry]:
        """The blocking read of new entries, behind the acknowledgements owed, in one round trip."""
        settles, self._settles = self._settles, []
        reply = self.store.settle_and_read(settles, self.name, self.settings.batch, self.settings.block_ms)
        return _entries(reply)

    def _settle_now(self) -> None:
        """Send the acknowledgements (and outbox clean-ups) deferred to the next write, now."""
        settles, self._settles = self._settles, []
        if settles:
            self.store.settle_commands_now(settles)

    def drain(self) -> BatchResult:
        """Finish what was read ahead, if anything (before a claim, and when stopping)."""
        batch, self._ready = self._ready, None
        unread, self._unread = self._unread, []
        result = BatchResult()
        if batch is not None:
            self._plan_held(batch)
            result = self._finish(batch, self._record(batch))
        self._settle_now()
        if unread:
            more = self.process(unread, redelivered=False)
            result.events += more.events
        return result

    def _read(self, start: str) -> list[Entry]:
        block = None if start == "0" else self.settings.block_ms
        reply = self.redis.xreadgroup(
            self.keys.group, self.name, {self.keys.events: start}, count=self.settings.batch, block=block
        )
        return _entries(reply)

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
        """One batch from read to acknowledgement, with nothing else in flight."""
        if not entries:
            return BatchResult()
        batch = self._prepare(entries, redelivered=redelivered)
        return self._finish(batch, self._record(batch))

    def _record(self, batch: Batch) -> dict[str, Recorded | None]:
        """The fast path's record of the batch, in a round trip of its own."""
        return self.store.record_steps(batch.planned, batch.now, batch.deadlines) if batch.planned else {}

    def _prepare(self, entries: list[Entry], *, redelivered: bool, held: frozenset[str] = frozenset()) -> Batch:
        """Decode the batch and plan its fast path: pure, no I/O (it runs while Redis works on the last one).

        The workflows in `held` are the previous batch's, not finished yet: they are planned by
        `_plan_held`, once that batch's step counts are known.
        """
        started, now = time.perf_counter(), time.time()
        groups, dead = self._decode(entries)
        batch = Batch(entries, redelivered, started, now, groups, dead, tracing.event_traces(groups))
        idle = f"{now + self.config.coordinator.in_doubt_after:.6f}"
        batch.deadlines = {
            e.workflow: idle for items in groups.values() for e, _ in items if type(e.data) is StepStarted
        }
        batch.held = held & groups.keys()
        batch.planned = self._plan_fresh(groups, now, batch.held)
        return batch

    def _plan_held(self, batch: Batch) -> None:
        if batch.held:
            batch.planned.update(self._plan_fresh({w: batch.groups[w] for w in batch.held}, batch.now, frozenset()))
            batch.held = frozenset()

    def _finish(self, batch: Batch, outcomes: dict[str, Recorded | None], *, defer: bool = False) -> BatchResult:
        """Everything after the fast path's commit: the compare-and-set path, dispatch, follow-ups, ack.

        `defer`: the acknowledgement is kept for the next write (`_settles`) instead of sent now.
        """
        entries, redelivered, now, groups, dead = batch.entries, batch.redelivered, batch.now, batch.groups, batch.dead
        result = BatchResult(events=len(entries))
        traces = batch.traces
        fresh = self._take_recorded(batch, outcomes)
        carried: dict[str, bool] = {}
        committed, contended, conflicts = self._fold(groups, now, dead, carried, traces)
        for view in committed:
            self._remember_steps(view.workflow, view.state.steps if view.state.status == "running" else None)
        fail_point("coordinator.after-commit")
        if redelivered:  # an earlier run may have committed without its WAIT succeeding
            self.store.confirm()
        result.jobs = self._dispatch(committed, ensure=redelivered, carried=carried)
        # The indexes say what the committed states say: re-derived for every workflow this batch
        # touched (so a redelivery repairs what a crash after the commit left undone), and for the
        # fast path's workflows when they were created or the entries are redelivered.
        items = [self._index_item(v) for v in committed if not v.indexed]
        # A workflow the fast path created or gave an intent's deadline to: on one Redis its script
        # indexed it already (Store.record_steps).
        deadlines = batch.deadlines
        for w, rec in fresh.items():
            indexed = rec.created or w in deadlines
            if (indexed and not self.store.indexes_in_commit) or redelivered:
                deadline = deadlines.get(w, "")
                items.append((w, f"{rec.created_at:.6f}", rec.version, "running", f"{rec.created_at:.6f}", deadline))
        # A workflow none of whose events could be folded has no state (it expired, say, before a
        # report or a step held by a dead or paused coordinator was claimed): the indexes must not
        # keep naming it in the status its last follow-up left, which may never have been written.
        folded = {v.workflow for v in committed}
        items += [gone_item(w) for w in groups if w not in folded and w not in contended]
        self.store.follow_up(items, committed, dead)
        unacked = {e.id for items_ in contended.values() for e, _ in items_}
        ack = [i for i, _ in entries if i.decode() not in unacked] if unacked else [i for i, _ in entries]
        if defer:
            self._settles += self.store.settle_commands(committed, ack)
        else:
            self.store.settle(committed, ack)
        result.conflicts, result.dead = conflicts, len(dead)
        for view in committed:
            result.statuses[view.workflow] = view.state.status
            if view.state.status != view.loaded_status and view.loaded_status is not None:
                log.info(
                    "workflow status", workflow=view.workflow, status=view.state.status, attention=view.state.attention
                )
        for entry_id, _, reason in dead:
            log.warning("dead-lettered an event", id=entry_id.decode(), reason=reason)
        metrics.observe_batch(
            entries, dead, committed, sum(r.created for r in fresh.values()), conflicts, batch.started
        )
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
            if (misrouted := self._misrouted(event.workflow)) is not None:
                dead.append((entry_id, fields, misrouted))
                continue
            groups[event.workflow].append((event, fields))
        return groups, dead

    def _misrouted(self, workflow: str) -> str | None:
        """Why an event of `workflow` does not belong on this partition's stream; None when it does.

        Another partition's coordinator owns its indexes and orders its events: folding it here
        would race that one, so it goes to the dead letters with the stream it belongs on.
        """
        keys = self.keys
        if keys.partitions == 1 or (part := keys.partition_of(workflow)) == keys.part:
            return None
        return (
            f"published to {keys.events}, but workflow {workflow!r} belongs to partition {part} "
            f"({keys.on(part).events}): partition = CLUSTER KEYSLOT <workflow> mod {keys.partitions}"
        )

    def _fold(
        self,
        groups: Groups,
        now: float,
        dead: list[DeadEntry],
        carried: dict[str, bool],
        traces: Mapping[str, dict[str, str]],
    ) -> tuple[list[WorkflowView], Groups, int]:
        """Load, fold and commit each workflow, again for those another coordinator changed meanwhile.

        Returns the committed views, the groups still contended after the retries (left unacknowledged:
        they come back) and the number of conflicts met. Rejected events are added to `dead`, and
        the jobs the commits carried to the queue to `carried` (Store.commit). Each committed
        transition of a traced workflow gets its span, begun before the commit (its jobs carry it).
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
            spans = tracing.begin_transitions([v for v in views.values() if v.state.version], traces, now)
            dirty = [v for v in views.values() if v.dirty]
            items = [self._index_item(v) for v in dirty] if self.store.indexes_in_commit else None
            lost = {
                v.workflow
                for v, ok in zip(dirty, self.store.commit(dirty, carried, items) if dirty else [], strict=True)
                if not ok
            }
            conflicts += len(lost)
            for workflow, view in views.items():
                if workflow in lost:
                    continue
                dead.extend(rejected.get(workflow, ()))
                if view.state.version:  # else every event was rejected and the workflow does not exist
                    committed.append(view)
                    if workflow in spans:
                        spans[workflow].end()
            pending = {w: pending[w] for w in lost}
        if pending:
            log.error("gave up on contended workflows this batch", workflows=sorted(pending))
        return committed, pending, conflicts

    def _index_item(self, view: WorkflowView) -> IndexItem:
        """What the indexes must say of a folded view (its deadline only where every record is known)."""
        return index_item(view, self.machine.next_deadline(view) if view.full else None, view.full)

    def _plan_fresh(self, groups: Groups, now: float, held: frozenset[str]) -> Planned:
        """The common case without a read: steps of running workflows, recorded by one script.

        The steps are planned here by the machine, numbered from the step count this coordinator
        last saw for the workflow (0 for one it never saw); the script writes them only if that
        count still holds (`_take_recorded` then removes them from `groups`; the rest stays there
        for the compare-and-set path). `held` workflows are left for later.
        """
        batches: Planned = {}
        counts = self._step_counts
        for workflow, items in groups.items():
            if workflow in held:
                continue
            steps = []
            names = set()
            for event, _ in items:
                data = event.data
                kind = type(data)
                if (kind is not StepCompleted and kind is not StepStarted) or data.step in names:  # type: ignore[union-attr]
                    break  # an intent and its result in one batch: the settle needs the record, so CAS
                names.add(data.step)  # type: ignore[union-attr]
                steps.append((data, event))
            else:
                base = counts.get(workflow, 0)
                plans = []
                machine = self.machine
                for n, (data, event) in enumerate(steps):
                    seq, repairs = base + n, event.repairs
                    if type(data) is StepStarted:
                        comp, entries = machine.plan_started(workflow, data, seq, now, event.id, repairs)
                    else:
                        comp, entries = machine.plan_step(workflow, data, seq, False, now, event.id, repairs)  # type: ignore[arg-type]
                    plans.append((comp, event.raw, entries))
                batches[workflow] = (base, plans)
        return batches

    def _take_recorded(self, batch: Batch, outcomes: dict[str, Recorded | None]) -> dict[str, Recorded]:
        """What the fast path recorded, per workflow, taken out of the batch's groups."""
        recorded = {w: outcome for w, outcome in outcomes.items() if outcome is not None}
        groups, planned, counts = batch.groups, batch.planned, self._step_counts
        if len(counts) + len(recorded) > STEP_COUNT_CACHE:
            counts.clear()  # a guess, not a fact: losing it costs one compare-and-set
        for workflow, outcome in recorded.items():
            del groups[workflow]
            counts[workflow] = planned[workflow][0] + outcome.steps
        return recorded

    def _remember_steps(self, workflow: str, count: int | None) -> None:
        """The step count the fast path numbers a workflow's next steps from (None: forget it)."""
        if count is None:
            self._step_counts.pop(workflow, None)
            return
        if len(self._step_counts) >= STEP_COUNT_CACHE and workflow not in self._step_counts:
            self._step_counts.clear()  # a guess, not a fact: losing it costs one compare-and-set
        self._step_counts[workflow] = count

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

    def _dispatch(self, views: list[WorkflowView], *, ensure: bool, carried: dict[str, bool]) -> int:
        """Enqueue the views' jobs (those their commit carried are queued already: `carried`), and log them."""
        jobs = [job for view in views for job in view.jobs]
        if ensure:  # a redelivered batch: its first run may have committed but not enqueued
            known = {(j.workflow, j.step, j.dispatch) for j in jobs}
            for view in views:
                for job in self.machine.jobs_in_flight(view):
                    if (job.workflow, job.step, job.dispatch) not in known:
                        jobs.append(job)
        rest = [job for job in jobs if job.job_id not in carried]
        queued = dict(carried)
        queued.update(zip((job.job_id for job in rest), enqueue_all(self.queue, rest, self.config.worker), strict=True))
        count = 0
        for job in jobs:
            if queued[job.job_id]:
                count += 1
                for one in (job, *job.then):  # a routing slip's steps are dispatches too
                    metrics.dispatched(one)
                log.info(
                    "dispatched compensation",
                    workflow=job.workflow,
                    step=job.step,
                    server=job.server,
                    operation=job.operation_id,
                    dispatch=job.dispatch,
                    slip=",".join(m.step for m in job.then) or None,
                )
        return count

    # Watchdog and housekeeping ------------------------------------------------------------

    def watch(self) -> int:
        """Look at workflows whose barrier or silence deadline passed.

        Before the machine decides, two facts outside the workflow's keys are read: which of its
        due compensations still have a worker's lease (a call in flight: not silent), and, for an
        expiring barrier, whether an entry of the workflow is still pending in the consumer group
        (a coordinator died or stalls holding a step: the barrier waits for its claim).
        """
        now = time.time()
        due = self.store.due(now)
        if not due:
            return 0
        views = self.store.load({w: (True, ()) for w in due})
        gone = [gone_item(w) for w, v in views.items() if not v.state.version]  # out of every index
        live = [v for v in views.values() if v.state.version]
        leased = self._alive({v.workflow: v for v in live}, now)
        barriers = {v.workflow for v in live if self.machine.barrier_due(v, now)}
        held = self._pending_workflows() & barriers if barriers else set()
        for view in live:
            self.machine.tick(view, now, leased.get(view.workflow, set()), hold_barrier=view.workflow in held)
            if view.workflow in held:
                log.info("barrier held: an entry of the workflow is still pending", workflow=view.workflow)
        dirty = [v for v in live if v.dirty]
        carried: dict[str, bool] = {}
        items = [self._index_item(v) for v in dirty] if self.store.indexes_in_commit else None
        oks = self.store.commit(dirty, carried, items) if dirty else []
        lost = {v.workflow for v, ok in zip(dirty, oks, strict=True) if not ok}
        committed = [v for v in live if v.workflow not in lost]
        metrics.transitions(committed)
        self._dispatch(committed, ensure=False, carried=carried)
        items = [self._index_item(v) for v in committed if not v.indexed]
        self.store.follow_up(items + gone, committed, [])
        self.store.settle(committed, [])
        return len(committed)

    def _alive(self, views: dict[str, WorkflowView], now: float) -> dict[str, set[str]]:
        """workflow -> its due compensations that are not silent, from facts outside its keys.

        Alive: the lease exists (a call in flight), or the job waits in the queue's list for a free
        worker (not merely RQ's `queued`: see Store.signs_of_life). Otherwise the attempt either
        ended or its worker died. An attempt that ended wrote
        its report with the release of its lease (one pipeline, report first), so while an entry of
        the workflow is pending or entries are not yet delivered, that report may be among them:
        not silent yet. That holds for a job RQ still shows as started too: a routing slip's job
        runs on after each of its steps reported. Else it is a worker that died: silent.
        """
        due = {w: self.machine.due_steps(v, now) for w, v in views.items()}
        signs = self.store.signs_of_life(
            {w: [(s, _job_of(views[w].comps[s])) for s in steps] for w, steps in due.items()}
        )
        quiet = {w for w, found in signs.items() if any(not ok and st != "queued" for ok, st in found.values())}
        unread: set[str] = set()
        if quiet:
            unread = quiet if self._undelivered() else self._pending_workflows() & quiet
        return {
            w: {s for s, (lease, st) in found.items() if lease or st == "queued" or w in unread}
            for w, found in signs.items()
        }

    def _undelivered(self) -> bool:
        """Whether `saga:events` holds entries the group has not delivered to any coordinator yet."""
        try:
            last = self.redis.xinfo_stream(self.keys.events)["last-generated-id"]
            groups = self.redis.xinfo_groups(self.keys.events)
        except ResponseError:
            return False
        mine = next((g for g in groups if g["name"] in (self.keys.group, self.keys.group.encode())), None)
        if mine is None:
            return True
        return stream_id(_text(mine["last-delivered-id"])) < stream_id(_text(last))

    def _pending_workflows(self, limit: int = 10_000) -> set[str]:
        """Workflows with an entry delivered to some coordinator and not acknowledged yet."""
        rows = self.redis.xpending_range(self.keys.events, self.keys.group, min="-", max="+", count=limit)
        if not rows:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for row in rows:
            pipe.xrange(self.keys.events, row["message_id"], row["message_id"], count=1)
        return {
            fields[b"workflow"].decode(errors="replace")
            for found in pipe.execute()
            for _, fields in found
            if fields.get(b"workflow")
        }

    def housekeeping(self) -> None:
        removed = self.store.collect_garbage(time.time())
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


def _entries(reply: Any) -> list[Entry]:
    """XREADGROUP's entries (a deleted entry, delivered with no fields, is left out)."""
    return [(i, f) for _, entries in reply for i, f in entries if f is not None] if reply else []


def _job_of(comp: Compensation) -> str:
    """The RQ job that carries the compensation's current dispatch: its own, or its slip's."""
    return comp.via or job_id_for(comp.idempotency_key or "", comp.dispatch)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _next_id(entry_id: str) -> str:
    ms, seq = stream_id(entry_id)
    return f"{ms}-{seq + 1}"
