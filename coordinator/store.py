"""Reading workflow views from Redis and committing transitions: the coordinator's only I/O on state.

Reads and writes are pipelined per batch of events: one round trip loads every workflow the batch
touches, one commits every transition (a compare-and-set Lua script per workflow, which also puts
the transition's outcomes in the workflow's own outbox), one performs the follow-ups that live
outside the workflow's slot (indexes and deadlines by one script, outcomes, dead letters), and only
when all of that was accepted does one more empty the outboxes and acknowledge the entries.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from importlib import resources
from typing import Any, NamedTuple

import msgspec
from mcp_saga.coordinator.machine import WorkflowView
from mcp_saga.runtime.connect import Lua, is_cluster
from mcp_saga.runtime.durability import Durability, Writes
from mcp_saga.runtime.reader import decode_records
from mcp_saga.schemas.config import CoordinatorSettings
from mcp_saga.schemas.keys import STATUSES, Keys, key_slot
from mcp_saga.schemas.records import Compensation, comp_decoder, comp_encoder, state_from_hash
from mcp_saga.schemas.timeline import DeadLetter, TimelineEntry
from redis import Redis
from redis.connection import Connection
from redis.exceptions import NoScriptError
from rq import Queue
from rq.job import Job

LOG_MAXLEN = 10_000
# record_steps.lua leaves a running workflow's TTL alone while more than its idle TTL is left, and
# gives it the TTL plus this fraction of it when it renews: one EXPIRE per key in that many steps.
TTL_SLACK_PARTS = 1000
DeadEntry = tuple[bytes, dict[bytes, bytes], str]  # id, original fields, reason
# One workflow's line for index.lua: workflow, createdAt, version, status, score, deadline.
IndexItem = tuple[str, str, int, str, str, str]


StepBatches = dict[str, tuple[int, list[tuple[Compensation, bytes, list[TimelineEntry]]]]]


class InFlight(NamedTuple):
    """record_steps' calls sent by `Store.record_ahead`, their replies not read yet."""

    connection: Connection
    batches: StepBatches
    now: float
    calls: list[tuple[list[str], list[str], list[Any]]]


class Recorded(NamedTuple):
    created: bool
    steps: int
    version: int
    created_at: float


def index_item(view: WorkflowView, deadline: float | None, known: bool) -> IndexItem:
    """What the indexes must say about a committed view (`known`: whether its deadline is)."""
    state = view.state
    where = ("-" if deadline is None else f"{deadline:.6f}") if known else ""
    score = state.updated_at or state.created_at  # when it entered the status, if it just did (ZADD NX)
    return (view.workflow, f"{state.created_at:.6f}", state.version, state.status, f"{score:.6f}", where)


def gone_item(workflow: str) -> IndexItem:
    """The index line of a workflow whose state the caller found gone: index.lua forgets it."""
    return (workflow, "0", 0, "", "0", "-")


def flat_entries(entries: list[TimelineEntry]) -> list[str | bytes | int]:
    """Timeline entries as the Lua scripts take them: per entry its field count, then name, value pairs."""
    args: list[str | bytes | int] = []
    for entry in entries:
        fields = entry.to_fields()
        args.append(len(fields))
        for pair in fields.items():
            args += pair
    return args


def load_script(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text()


class Store:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: CoordinatorSettings,
        *,
        durability: Durability | None = None,
        queue: Queue | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        # RQ's queue, whose Redis holds the jobs' records (a standalone one beside a cluster).
        self.queue = queue if queue is not None else Queue(keys.queue, connection=redis)
        # With it, every commit pipeline ends with WAIT, and a commit too few replicas confirmed
        # raises NotReplicated before anything is dispatched or acknowledged.
        self.durability = durability
        self.cluster = is_cluster(redis)
        self._apply = Lua(redis, load_script("apply.lua"))
        self._record_steps = Lua(redis, load_script("record_steps.lua"))
        self._index = Lua(redis, load_script("index.lua"))
        self._forget = Lua(redis, load_script("forget.lua"))

    def load(self, wanted: dict[str, tuple[bool, Iterable[str]]]) -> dict[str, WorkflowView]:
        """Load views: workflow -> (needs every record?, step ids the batch names).

        With each view comes its outbox: outcomes of earlier transitions not yet written out
        (their coordinator died in between), which this batch's follow-up writes.
        """
        pipe = self.redis.pipeline(transaction=False)
        for workflow, (full, steps) in wanted.items():
            pipe.hgetall(self.keys.state(workflow))
            if full:
                pipe.hgetall(self.keys.comp(workflow))
            else:
                pipe.hmget(self.keys.comp(workflow), list(steps) or ["-"])
            pipe.lrange(self.keys.outbox(workflow), 0, -1)
        replies = iter(pipe.execute())
        views = {}
        for workflow, (full, steps) in wanted.items():
            state = state_from_hash(next(replies))
            records = next(replies)
            if full:
                comps = decode_records(records)
            else:
                comps = {s: comp_decoder.decode(v) for s, v in zip(steps, records, strict=False) if v is not None}
            views[workflow] = WorkflowView(workflow, state, comps, full, outbox=list(next(replies)))
        return views

    def ttl_for(self, status: str) -> int:
        s = self.settings
        return {
            "completed": s.retention_completed,
            "compensated": s.retention_compensated,
            "needs-attention": s.retention_attention,
        }.get(status, s.idle_ttl)

    def commit(self, views: list[WorkflowView]) -> list[bool]:
        """Apply each dirty view atomically; False where another coordinator changed it meanwhile."""
        writes = Writes(self.redis, self.durability)
        for view in views:
            state = view.state
            args: list[str | bytes | int] = [
                view.loaded_version,
                self.ttl_for(state.status),
                LOG_MAXLEN,
                len(state_pairs := state.to_hash()),
                len(view.changed),
                len(view.new_steps),
                len(view.log),
                self.outbox_item(view),
            ]
            for k, v in state_pairs.items():
                args += (k, v)
            for step, comp in view.changed.items():
                args += (step, comp_encoder.encode(comp))
            args += view.new_steps
            args += flat_entries(view.log)
            for position, raw in view.set_steps.items():
                args += (position, raw)
            keys = self.keys.workflow_keys(view.workflow)
            self._apply(keys=keys, args=args, client=writes.pipe(keys[0]))
        oks = [bool(ok) for ok in writes.execute("coordinator commit")]
        for view, ok in zip(views, oks, strict=True):
            if ok and view.outcomes:
                view.outbox.append(self.outbox_item(view))
        return oks

    def confirm(self) -> None:
        """WAIT for what was written before, for a redelivered batch whose commit came earlier."""
        Writes(self.redis, self.durability).confirm("coordinator earlier commit")

    def outbox_item(self, view: WorkflowView) -> bytes | str:
        """The transition's outcomes, each with an `id` that names it across re-sends."""
        if not view.outcomes:
            return ""
        base = f"{view.workflow}/{view.state.created_at:.6f}/{view.state.version}"
        return msgspec.json.encode(
            [msgspec.structs.replace(o, id=f"{base}/{n}").to_fields() for n, o in enumerate(view.outcomes)]
        )

    def record_steps(self, batches: StepBatches, now: float) -> dict[str, Recorded | None]:
        """Record new steps of workflows believed running, without loading them first.

        workflow -> (the step count the records were numbered from, the planned steps). Returns
        what was recorded, or None where the expectation did not hold (not running, other steps
        recorded meanwhile, a step already recorded): nothing was written, and the caller folds
        those events through the compare-and-set path.
        """
        writes = Writes(self.redis, self.durability)
        groups = self._record_calls(batches, now)
        for _, keys, args in groups:  # each call's keys are in one slot
            self._record_steps(keys=keys, args=args, client=writes.pipe(keys[0]))
        return self._recorded(batches, groups, writes.execute("coordinator steps"))

    def _record_calls(self, batches: StepBatches, now: float) -> list[tuple[list[str], list[str], list[Any]]]:
        """record_steps.lua's calls: (workflows, keys, args), one per slot (on one Redis: one for the batch)."""
        slots: dict[int, list[str]] = {}
        for workflow in batches:
            slots.setdefault(key_slot(self.keys.state(workflow)) if self.cluster else 0, []).append(workflow)
        ttl = self.settings.idle_ttl
        calls = []
        for workflows in slots.values():
            keys: list[str] = []
            args: list[Any] = [f"{now:.6f}", ttl, ttl // TTL_SLACK_PARTS, LOG_MAXLEN]
            for workflow in workflows:
                expected, steps = batches[workflow]
                keys += self.keys.workflow_keys(workflow)
                args += (expected, len(steps))
                for comp, raw, entries in steps:
                    args += (comp.step, comp_encoder.encode(comp), raw, len(entries))
                    if entries:
                        args += flat_entries(entries)
            calls.append((workflows, keys, args))
        return calls

    @staticmethod
    def _recorded(
        batches: StepBatches, calls: list[tuple[list[str], list[str], list[Any]]], replies: list[Any]
    ) -> dict[str, Recorded | None]:
        found: dict[str, Recorded | None] = {}
        for (workflows, _, _), reply in zip(calls, replies, strict=True):
            for workflow, one in zip(workflows, reply, strict=True):
                count = len(batches[workflow][1])
                found[workflow] = Recorded(bool(one[1]), count, int(one[2]), float(one[3])) if one[0] else None
        return found

    @property
    def overlaps(self) -> bool:
        """Whether `record_ahead` may be used: one Redis, and no WAIT to append to the commit."""
        return not self.cluster and self.durability is None

    def record_ahead(self, ahead: tuple[Any, ...], batches: StepBatches, now: float) -> tuple[Any, InFlight]:
        """Send the command `ahead` and then `record_steps`' calls in one write, on a connection of
        their own; return `ahead`'s reply as soon as it is read, and the recording to `collect`.

        The coordinator sends the next read ahead of a batch's commit: Redis answers it first and
        then runs the scripts, while the coordinator plans the batch it just read.
        """
        calls = self._record_calls(batches, now) if batches else []
        sha = self._record_steps.sha
        pool = self.redis.connection_pool
        connection = pool.get_connection()
        try:
            commands = [ahead, *(("EVALSHA", sha, len(keys), *keys, *args) for _, keys, args in calls)]
            connection.send_packed_command(connection.pack_commands(commands))
            reply = self.redis.parse_response(connection, str(ahead[0]))
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        return reply, InFlight(connection, batches, now, calls)

    def collect(self, flight: InFlight) -> dict[str, Recorded | None]:
        """The replies of what `record_ahead` sent; a script Redis did not have is loaded and run again."""
        pool = self.redis.connection_pool
        replies: list[Any] = []
        missing = False
        try:
            for _ in flight.calls:
                try:
                    replies.append(flight.connection.read_response())
                except NoScriptError:  # a restart or SCRIPT FLUSH: the synchronous path loads it
                    replies.append(None)
                    missing = True
        except BaseException:
            flight.connection.disconnect()
            raise
        finally:
            pool.release(flight.connection)
        if missing:
            done = [(call, r) for call, r in zip(flight.calls, replies, strict=True) if r is not None]
            found = self._recorded(flight.batches, [c for c, _ in done], [r for _, r in done])
            lost = [ws for (ws, _, _), r in zip(flight.calls, replies, strict=True) if r is None]
            again = {w: flight.batches[w] for ws in lost for w in ws}
            return found | self.record_steps(again, flight.now)
        return self._recorded(flight.batches, flight.calls, replies)

    def follow_up(self, items: list[IndexItem], views: list[WorkflowView], dead: list[DeadEntry]) -> None:
        """What lives outside the workflows' slots: indexes and deadlines, outcomes, dead letters.

        An item whose workflow's state is gone by the time it is written forgets the workflow
        instead (index.lua; on a cluster only the `gone_item`s, whose state the caller found gone).

        Raises (a `ResponseError`, e.g. OOM) when Redis refused any of it; the caller then
        acknowledges nothing, so every entry comes back and all of this is written again: the
        index script is idempotent and ignores what is older than it already reflects, outcomes
        stay in their workflow's outbox until written (at least once, each with a stable `id`).
        """
        pipe = self.redis.pipeline(transaction=False)
        if items:
            args: list[str | int | float] = [len(STATUSES), *STATUSES, len(items)]
            for item in items:
                args += item
            keys = self.keys.index_keys()
            if not self.cluster:  # the script checks that each item's state is still there
                keys += [self.keys.state(item[0]) for item in items]
            self._index(keys=keys, args=args, client=pipe)
        for view in views:
            for raw in view.outbox:
                for outcome in msgspec.json.decode(raw):
                    pipe.xadd(self.keys.outcomes, outcome, maxlen=self.settings.outcomes_maxlen, approximate=True)
        for entry_id, fields, reason in dead:
            record = DeadLetter.record(entry_id, fields, reason, time.time())
            pipe.xadd(self.keys.dead_letter, record, maxlen=self.settings.dead_letter_maxlen, approximate=True)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise reply

    def settle(self, views: list[WorkflowView], ack: list[bytes]) -> None:
        """After `follow_up` succeeded: empty the outboxes it wrote out, and acknowledge the entries."""
        pipe = self.redis.pipeline(transaction=False)
        for view in views:
            for raw in view.outbox:
                pipe.lrem(self.keys.outbox(view.workflow), 1, raw)  # by value: a second writer removes nothing
        if ack:
            pipe.xack(self.keys.events, self.keys.group, *ack)
        if len(pipe):
            for reply in pipe.execute(raise_on_error=False):
                if isinstance(reply, Exception):
                    raise reply

    def due(self, now: float, limit: int = 100) -> list[str]:
        return [w.decode() for w in self.redis.zrangebyscore(self.keys.deadlines, "-inf", now, start=0, num=limit)]

    def signs_of_life(self, wanted: dict[str, list[tuple[str, str]]]) -> dict[str, dict[str, tuple[bool, str]]]:
        """workflow -> step -> (lease key exists, RQ status of the dispatch's job or '' if gone).

        `wanted`: workflow -> (step, job id of its current dispatch), for the steps the watchdog
        found due. One round trip to each Redis for all of them.

        `queued` is RQ's status from enqueue until a worker marks the job started, and a worker
        takes it out of the queue's list first: one that dies in between leaves it `queued` in no
        list a worker reads (RQ's own clean-up finds it at a worker's maintenance, ten to twenty
        minutes later). So `queued` is returned only for a job that is in the queue's list, waiting
        for a free worker; one taken out of it and not started says `dequeued`.
        """
        rows = [(w, s, j) for w, steps in wanted.items() for s, j in steps]
        if not rows:
            return {w: {} for w in wanted}
        leases = self.redis.pipeline(transaction=False)
        jobs = self.queue.connection.pipeline(transaction=False)
        for workflow, step, job_id in rows:
            leases.exists(self.keys.lease(workflow, step))
            jobs.hget(Job.key_for(job_id), "status")
            jobs.lpos(self.queue.key, job_id)
        held, seen = iter(leases.execute()), iter(jobs.execute())
        found: dict[str, dict[str, tuple[bool, str]]] = {w: {} for w in wanted}
        for workflow, step, _ in rows:
            alive, status, waiting = next(held), next(seen), next(seen)
            text = status.decode() if status else ""
            found[workflow][step] = (bool(alive), "dequeued" if text == "queued" and waiting is None else text)
        return found

    def collect_garbage(self, now: float | None = None, page: int = 1000, budget: int = 20) -> int:
        """Drop index and deadline entries whose workflow expired (its keys are gone).

        An index entry's score is when its workflow entered that status, and a workflow in it
        lives at least that status's retention (idle TTL for the unsettled ones) after its last
        change (a running one up to TTL_SLACK_PARTS-th of it longer): so only entries older than
        that can be gone, and they sit at the low end of the sorted set; one still alive is kept.
        Each sweep reads them a page at a time, up to `budget` pages, so the work follows the
        rate workflows expire at instead of a fixed slice of every index.
        """
        now = time.time() if now is None else now
        removed = 0
        for key, ttl in [(self.keys.index(s), self.ttl_for(s)) for s in STATUSES] + [
            (self.keys.deadlines, self.settings.idle_ttl)
        ]:
            offset = 0
            for _ in range(budget):
                names = [m.decode() for m in self.redis.zrangebyscore(key, "-inf", now - ttl, start=offset, num=page)]
                if not names:
                    break
                pipe = self.redis.pipeline(transaction=False)
                for workflow in names:
                    pipe.exists(self.keys.state(workflow))
                alive = pipe.execute()
                gone = [w for w, a in zip(names, alive, strict=True) if not a]
                if gone:
                    removed += self._forget(keys=self.keys.index_keys(), args=gone)
                offset += len(names) - len(gone)  # the ones still alive stay in front
                if len(names) < page:
                    break
        return removed
