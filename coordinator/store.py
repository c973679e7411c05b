"""Reading workflow views from Redis and committing transitions: the coordinator's only I/O on state.

Reads and writes are pipelined per batch of events: one round trip loads every workflow the batch
touches, one commits every transition (a compare-and-set Lua script per workflow). On one Redis that
script also writes the transition's index line and its outcomes (`Store.indexes_in_commit`); on a
cluster, where those live in other slots, it puts the outcomes in the workflow's own outbox and one
more round trip performs the follow-ups (indexes and deadlines by one script, outcomes). Dead
letters, and the index lines of redelivered batches, go by that follow-up everywhere. Only when all
of that was accepted are the outboxes emptied and the entries acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple

import msgspec
from mcp_saga.coordinator.machine import WorkflowView
from mcp_saga.coordinator.queue import is_due, unique_call
from mcp_saga.runtime.connect import Lua, is_cluster
from mcp_saga.runtime.durability import Durability, Writes
from mcp_saga.runtime.packing import pack
from mcp_saga.runtime.reader import decode_records
from mcp_saga.schemas.config import CoordinatorSettings, WorkerSettings
from mcp_saga.schemas.keys import STATUSES, Keys, key_slot
from mcp_saga.schemas.records import Compensation, CompensationJob, comp_decoder, comp_encoder, state_from_hash
from mcp_saga.schemas.timeline import DeadLetter, FlatEntry, Outcome, TimelineEntry
from redis import Redis
from redis.connection import Connection
from redis.exceptions import NoScriptError, ResponseError
from rq import Queue
from rq.job import Job

LOG_MAXLEN = 10_000
# Workflows whose keys and id `Store._packed_record` keeps packed (cleared when full: a cache, not a fact).
PACKED_KEYS_CACHE = 20_000
# A step's three arguments to record_steps.lua (id, record, raw step) as bulk strings, in one format.
STEP_BULKS = b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n"
# A workflow's arguments with one step, no timeline entry and no deadline: expected count, 1, 0, then
# its id (packed already) and an empty deadline, then the step.
ONE_STEP_BULKS = b"$%d\r\n%s\r\n$1\r\n1\r\n$1\r\n0\r\n%s$0\r\n\r\n" + STEP_BULKS
# record_steps.lua leaves a running workflow's TTL alone while more than its idle TTL is left, and
# gives it the TTL plus this fraction of it when it renews: one EXPIRE per key in that many steps.
TTL_SLACK_PARTS = 1000
DeadEntry = tuple[bytes, dict[bytes, bytes], str]  # id, original fields, reason
# One workflow's line for index.lua: workflow, createdAt, version, status, score, deadline.
IndexItem = tuple[str, str, int, str, str, str]


StepBatches = dict[str, tuple[int, list[tuple[Compensation, bytes, list[TimelineEntry]]]]]


class InFlight(NamedTuple):
    """What `Store.record_ahead` sent and has not read the replies of yet: record_steps' call, if
    any (`workflows` empty: none), then the commands of `trail`."""

    connection: Connection
    batches: StepBatches
    now: float
    workflows: list[str]
    trail: tuple[str, ...]
    deadlines: Mapping[str, str]


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


def flat_entries(entries: Sequence[FlatEntry]) -> list[str | bytes | int]:
    """Timeline entries as the Lua scripts take them: per entry its field count, then name, value pairs."""
    args: list[str | bytes | int] = []
    for entry in entries:
        fields = entry.to_fields()
        args.append(len(fields))
        for pair in fields.items():
            args += pair
    return args


def _recorded(batches: StepBatches, workflows: list[str], reply: list[Any]) -> dict[str, Recorded | None]:
    """record_steps.lua's flat reply: per workflow its version (negative: created) and createdAt."""
    found: dict[str, Recorded | None] = {}
    for n, workflow in enumerate(workflows):
        version = reply[2 * n]
        found[workflow] = (
            Recorded(version < 0, len(batches[workflow][1]), abs(version), float(reply[2 * n + 1])) if version else None
        )
    return found


def _read_entries(reply: Any) -> list[Any]:
    """An XREADGROUP reply exactly as redis-py's own parsing gives it ([[stream, [(id, fields)]]]),
    built here from the raw one (a map under RESP3, redis-py 8's default; a list under RESP2),
    in one pass instead of redis-py's three layers of callbacks. A deleted entry's fields are {}."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    return [
        [name, [(None, None) if e is None else (e[0], dict(zip(f := iter(e[1] or ()), f, strict=False))) for e in got]]
        for name, got in streams
    ]


def _bulks(values: Iterable[str | bytes | int | float]) -> bytes:
    """Values as the protocol's bulk strings, encoded the way redis-py encodes arguments."""
    out = []
    for value in values:
        data = value if isinstance(value, bytes) else (value if isinstance(value, str) else repr(value)).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


# The shared Lua a script is sent with (a Redis script is one chunk): put in front of its own text.
LUA_LIBRARIES = {name: ("index_lib.lua",) for name in ("apply.lua", "index.lua", "record_steps.lua")}


def load_script(name: str) -> str:
    folder = resources.files(__package__).joinpath("lua")
    return "\n".join(folder.joinpath(part).read_text() for part in (*LUA_LIBRARIES.get(name, ()), name))


class _Write:
    """The commands of one commit, in order. On one Redis without a WAIT to append (`Store.overlaps`)
    they are packed by hiredis and sent on one connection: redis-py packs each argument in Python,
    about 110 µs for the two commands of a failure's commit (its script and its carried job, some 100
    arguments each) against 36 µs here, on the path from a failure to its compensation. Elsewhere
    (a cluster's EVALs by slot, `wait_replicas`) they go through `Writes`.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.writes = None if store.overlaps else Writes(store.redis, store.durability)
        self.packed: list[bytes] = []

    def script(self, lua: Lua, keys: list[str] | tuple[str, ...], args: list[Any]) -> None:
        if self.writes is None:
            self.packed.append(pack(("EVALSHA", lua.sha, len(keys), *keys, *args)))
        else:
            lua.queue(self.writes.pipe(keys[0]), keys, args)

    def command(self, key: str, *args: Any) -> None:
        if self.writes is None:
            self.packed.append(pack(args))
        else:
            self.writes.pipe(key).execute_command(*args)

    def execute(self, what: str) -> list[Any]:
        """The replies in order; an error reply raises (the first), after every reply was read."""
        if self.writes is not None:
            return self.writes.execute(what)
        pool = self.store.redis.connection_pool
        connection = pool.get_connection()
        replies: list[Any] = []
        try:
            connection.send_packed_command(self.packed)
            for _ in self.packed:
                try:
                    replies.append(connection.read_response())
                except ResponseError as exc:  # read, the connection stays in step: the rest follow
                    replies.append(exc)
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies


class Store:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        settings: CoordinatorSettings,
        *,
        durability: Durability | None = None,
        queue: Queue | None = None,
        worker: WorkerSettings | None = None,
    ) -> None:
        """`worker`: the settings the jobs are enqueued with, to let a commit carry its due jobs (`commit`)."""
        self.redis = redis
        self.keys = keys
        self.settings = settings
        # RQ's queue, whose Redis holds the jobs' records (a standalone one beside a cluster).
        self.queue = queue if queue is not None else Queue(keys.queue, connection=redis)
        self.worker = worker
        # With it, every commit pipeline ends with WAIT, and a commit too few replicas confirmed
        # raises NotReplicated before anything is dispatched or acknowledged.
        self.durability = durability
        self.cluster = is_cluster(redis)
        self._apply = Lua(redis, load_script("apply.lua"))
        self._record_steps = Lua(redis, load_script("record_steps.lua"))
        self._index = Lua(redis, load_script("index.lua"))
        self._forget = Lua(redis, load_script("forget.lua"))
        self._enqueue_planned = Lua(redis, load_script("enqueue_planned.lua"))
        # A commit carries its due jobs where one pipeline reaches both (one Redis holds the records
        # and the queue) and nothing must be confirmed between them (no WAIT for replicas first).
        self.carries = worker is not None and not self.cluster and durability is None and self.queue.connection is redis
        self._packed_keys: dict[str, tuple[bytes, bytes]] = {}  # workflow -> its keys, its id
        self._loaded = False  # whether this Store put its scripts in the cache (commit's digest needs it)

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

    @property
    def indexes_in_commit(self) -> bool:
        """Whether a commit given its index items writes them, and its outcomes, in its own script.

        On one Redis a script may touch the indexes and the outcomes stream beside the workflow's
        keys, so the transition, its index item and its outcomes are one atomic write: no follow-up
        round trip behind each commit, no outbox to empty after it, and no window in which a crash
        leaves them unwritten. On a cluster they live in other slots: the outbox and the follow-up.
        """
        return not self.cluster

    def commit(
        self, views: list[WorkflowView], carried: dict[str, bool] | None = None, items: list[IndexItem] | None = None
    ) -> list[bool]:
        """Apply each dirty view atomically; False where another coordinator changed it meanwhile.

        `items`: each view's index item (`index_item`), in view order, written by the commit itself
        together with the view's outcomes where `indexes_in_commit`; the caller's follow-up then
        leaves out the views that committed. Without them, or on a cluster, the outcomes go to
        the workflow's outbox and the caller's follow-up writes both.

        By digest, the script loaded before the first commit: a Redis that lost it since (restarted,
        failed over, flushed) raises NoScriptError here, and the coordinator loads the scripts again
        and reads its pending entries again, as after a crash between this write and the next
        (Coordinator.run): what did commit folds to no change, its jobs re-ensured.

        `carried`: where the commit may carry the views' due jobs (`carries`), each behind its
        view's script in the same round trip, queued only if the records it dispatches are as this
        commit writes them (enqueue_planned.lua); job id -> queued (False: it existed already), for
        the committed views. The others' jobs queued nothing and are planned again.
        """
        if not self._loaded:
            self.load_scripts()
        writes = _Write(self)
        carry = carried is not None and self.carries
        # What each reply answers: (-1, None) the queue's registration, (n, None) view n's commit,
        # (n, job) a job carried behind it.
        sent: list[tuple[int, CompensationJob | None]] = []
        if carry and any(view.jobs for view in views):
            writes.command(self.queue.key, "SADD", self.queue.redis_queues_keys, self.queue.key)
            sent.append((-1, None))
        inline = items is not None and self.indexes_in_commit
        for n, view in enumerate(views):
            state = view.state
            outcomes = self.outcome_entries(view) if inline else []
            args: list[str | bytes | int] = [
                view.loaded_version,
                self.ttl_for(state.status),
                LOG_MAXLEN,
                len(state_pairs := state.to_hash()),
                len(view.changed),
                len(view.new_steps),
                len(view.log),
                "" if inline else self.outbox_item(view),
                len(view.set_steps),
                len(outcomes),
                self.settings.outcomes_maxlen,
            ]
            for k, v in state_pairs.items():
                args += (k, v)
            records = {step: comp_encoder.encode(comp) for step, comp in view.changed.items()}
            for step, raw in records.items():
                args += (step, raw)
            args += view.new_steps
            args += flat_entries(view.log)
            for position, raw in view.set_steps.items():
                args += (position, raw)
            keys: tuple[str, ...] | list[str] = self.keys.workflow_keys(view.workflow)
            if inline:
                assert items is not None
                args += flat_entries(outcomes)
                args += (len(STATUSES), *STATUSES, *items[n])
                keys = [*keys, self.keys.outcomes, *self.keys.index_keys()]
            writes.script(self._apply, keys, args)
            sent.append((n, None))
            if carry:
                sent += ((n, job) for job in self._carry(writes, view, records))
        oks: list[bool] = []
        jobs: list[tuple[int, CompensationJob, Any]] = []
        for (n, job), reply in zip(sent, writes.execute("coordinator commit"), strict=True):
            if job is not None:
                jobs.append((n, job, reply))
            elif n >= 0:
                oks.append(bool(reply))
        for n, job, reply in jobs:  # -1 behind a commit that applied: not its records (then enqueued as usual)
            if oks[n] and reply != -1:
                carried[job.job_id] = reply == 1  # type: ignore[index]
        for view, ok in zip(views, oks, strict=True):
            view.indexed = ok and inline
            if ok and view.outcomes and not inline:
                view.outbox.append(self.outbox_item(view))
        return oks

    def _carry(self, writes: _Write, view: WorkflowView, records: dict[str, bytes]) -> list[CompensationJob]:
        """Queue the view's due jobs behind its script; those whose records it does not write go later."""
        assert self.worker is not None
        carried = []
        comp = self.keys.comp(view.workflow)
        for job in view.jobs:
            members = (job, *job.then)
            if not is_due(job) or any(m.step not in records for m in members):
                continue
            job_key, queue_key, *rest = unique_call(self.queue, job, self.worker)
            planned = [len(members), *(part for m in members for part in (m.step, records[m.step])), *rest]
            writes.script(self._enqueue_planned, [comp, job_key, queue_key], planned)
            carried.append(job)
        return carried

    def confirm(self) -> None:
        """WAIT for what was written before, for a redelivered batch whose commit came earlier."""
        Writes(self.redis, self.durability).confirm("coordinator earlier commit")

    def outcome_entries(self, view: WorkflowView) -> list[Outcome]:
        """The transition's outcomes, each with an `id` that names it across re-sends."""
        base = f"{view.workflow}/{view.state.created_at:.6f}/{view.state.version}"
        return [msgspec.structs.replace(o, id=f"{base}/{n}") for n, o in enumerate(view.outcomes)]

    def outbox_item(self, view: WorkflowView) -> bytes | str:
        """The transition's outcomes as its outbox holds them (JSON), for the follow-up to write out."""
        if not view.outcomes:
            return ""
        return msgspec.json.encode([o.to_fields() for o in self.outcome_entries(view)])

    def record_steps(
        self, batches: StepBatches, now: float, deadlines: Mapping[str, str] = {}
    ) -> dict[str, Recorded | None]:
        """Record new steps of workflows believed running, without loading them first.

        workflow -> (the step count the records were numbered from, the planned steps). Returns
        what was recorded, or None where the expectation did not hold (not running, other steps
        recorded meanwhile, a step already recorded): nothing was written, and the caller folds
        those events through the compare-and-set path.

        Where `indexes_in_commit`, the script also puts each workflow it creates, and each one
        `deadlines` names (workflow -> watchdog deadline: an intent's), in the `running` index.
        """
        writes = Writes(self.redis, self.durability)
        groups = self._record_calls(batches, now, deadlines)
        for _, keys, args in groups:  # each call's keys are in one slot
            self._record_steps(keys=keys, args=args, client=writes.pipe(keys[0]))
        replies = writes.execute("coordinator steps")
        found: dict[str, Recorded | None] = {}
        for (workflows, _, _), reply in zip(groups, replies, strict=True):
            found |= _recorded(batches, workflows, reply)
        return found

    def _record_calls(
        self, batches: StepBatches, now: float, deadlines: Mapping[str, str] = {}
    ) -> list[tuple[list[str], list[str], list[Any]]]:
        """record_steps.lua's calls: (workflows, keys, args), one per slot (on one Redis: one for the batch)."""
        slots: dict[int, list[str]] = {}
        for workflow in batches:
            slots.setdefault(key_slot(self.keys.state(workflow)) if self.cluster else 0, []).append(workflow)
        calls = []
        for workflows in slots.values():
            keys: list[str] = self._record_index_keys()
            args: list[Any] = self._record_head(now)
            for workflow in workflows:
                expected, steps = batches[workflow]
                keys += self.keys.workflow_keys(workflow)
                entries = [entry for _, _, logged in steps for entry in logged]
                args += (expected, len(steps), len(entries), workflow, deadlines.get(workflow, ""))
                for comp, raw, _ in steps:
                    args += (comp.step, comp_encoder.encode(comp), raw)
                args += flat_entries(entries)
            calls.append((workflows, keys, args))
        return calls

    def _record_index_keys(self) -> list[str]:
        """The index keys record_steps.lua declares in front of the workflows' (none on a cluster)."""
        return self.keys.index_keys() if self.indexes_in_commit else []

    def _record_head(self, now: float) -> list[Any]:
        ttl = self.settings.idle_ttl
        statuses = STATUSES if self.indexes_in_commit else ()
        return [f"{now:.6f}", ttl, ttl // TTL_SLACK_PARTS, LOG_MAXLEN, len(statuses), *statuses]

    def _packed_record(self, batches: StepBatches, now: float, deadlines: Mapping[str, str] = {}) -> bytes:
        """The one EVALSHA of `_record_calls` on one Redis, written in the protocol directly.

        The same command, byte for byte (a test holds the two together), without a list of
        arguments for redis-py to pack one by one: packing cost the coordinator more than
        encoding the records did. Each workflow's keys and id are packed once and kept.
        """
        head_keys = self._record_index_keys()
        keys: list[bytes] = [_bulks(head_keys)]
        head = self._record_head(now)
        args: list[bytes] = [_bulks(head)]
        count = len(head)
        for workflow, (expected, steps) in batches.items():
            packed = self._packed_keys.get(workflow)
            if packed is None:
                if len(self._packed_keys) >= PACKED_KEYS_CACHE:
                    self._packed_keys.clear()
                packed = self._packed_keys[workflow] = (_bulks(self.keys.workflow_keys(workflow)), _bulks((workflow,)))
            keys.append(packed[0])
            logged = [entry for _, _, entries in steps for entry in entries]
            count += 5 + 3 * len(steps)
            deadline = deadlines.get(workflow, "")
            if len(steps) == 1 and not logged and not deadline:  # the common case: its arguments in one format
                comp, raw, _ = steps[0]
                step, record, seen = comp.step.encode(), comp_encoder.encode(comp), b"%d" % expected
                args.append(
                    ONE_STEP_BULKS % (len(seen), seen, packed[1], len(step), step, len(record), record, len(raw), raw)
                )
                continue
            args.append(_bulks((expected, len(steps), len(logged))) + packed[1] + _bulks((deadline,)))
            for comp, raw, _ in steps:
                step, record = comp.step.encode(), comp_encoder.encode(comp)
                args.append(STEP_BULKS % (len(step), step, len(record), record, len(raw), raw))
            if logged:
                flat = flat_entries(logged)
                args.append(_bulks(flat))
                count += len(flat)
        nkeys = len(head_keys) + 5 * len(batches)
        command = _bulks(("EVALSHA", self._record_steps.sha, nkeys))
        return b"*%d\r\n%s%s%s" % (3 + nkeys + count, command, b"".join(keys), b"".join(args))

    @property
    def overlaps(self) -> bool:
        """Whether `record_ahead` may be used: one Redis, and no WAIT to append to the commit."""
        return not self.cluster and self.durability is None

    def record_ahead(
        self,
        ahead: tuple[Any, ...] | None,
        batches: StepBatches,
        now: float,
        trail: list[tuple[Any, ...]] = (),
        deadlines: Mapping[str, str] = {},
    ) -> tuple[Any, InFlight]:
        """Send the command `ahead`, then `record_steps`' call, then the commands of `trail`, in one
        write on a connection of their own; return `ahead`'s reply as soon as it is read (None
        without one), and the rest to `collect` and `read_trail`.

        The coordinator sends a read ahead of a batch's commit, or behind it: Redis runs the
        script while the coordinator plans the batch it read before, and the read behind it is
        answered by the time the batch is finished (see Coordinator._overlapped).
        """
        pool = self.redis.connection_pool
        connection = pool.get_connection()
        try:
            # hiredis packs each command in one call; redis-py's pack_commands wraps it in a pass
            # over every argument (an XACK names a hundred) and a copy into its buffers.
            packed = [] if ahead is None else [pack(ahead)]
            if batches:
                packed.append(self._packed_record(batches, now, deadlines))
            packed += [pack(command) for command in trail]
            connection.send_packed_command(packed)
            reply = None if ahead is None else self.redis.parse_response(connection, str(ahead[0]))
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        return reply, InFlight(connection, batches, now, list(batches), tuple(str(c[0]) for c in trail), deadlines)

    def collect(self, flight: InFlight) -> dict[str, Recorded | None]:
        """The reply of what `record_ahead` sent; a script Redis did not have is loaded and run again.

        The connection stays taken while `trail` replies are still to be read (`read_trail`).
        """
        if not flight.batches:
            if not flight.trail:
                self.redis.connection_pool.release(flight.connection)
            return {}
        try:
            reply = flight.connection.read_response()
        except NoScriptError:  # a restart or SCRIPT FLUSH: the synchronous path loads it
            outcomes = self.record_steps(flight.batches, flight.now, flight.deadlines)
            if not flight.trail:
                self.redis.connection_pool.release(flight.connection)
            return outcomes
        except BaseException:
            self.discard(flight)
            raise
        if not flight.trail:
            self.redis.connection_pool.release(flight.connection)
        return _recorded(flight.batches, flight.workflows, reply)

    def discard(self, flight: InFlight) -> None:
        """Give up on the replies `record_ahead` sent for: its connection is closed and returned."""
        flight.connection.disconnect()
        self.redis.connection_pool.release(flight.connection)

    def read_trail(self, flight: InFlight) -> list[Any]:
        """The replies of `record_ahead`'s trail, each parsed as its command's; an error reply raises."""
        pool = self.redis.connection_pool
        try:
            return [
                _read_entries(flight.connection.read_response())
                if name == "XREADGROUP"
                else self.redis.parse_response(flight.connection, name)
                for name in flight.trail
            ]
        except BaseException:
            flight.connection.disconnect()
            raise
        finally:
            pool.release(flight.connection)

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
            self._index.queue(pipe, keys, args)
        for view in views:
            for raw in view.outbox:
                for outcome in msgspec.json.decode(raw):
                    pipe.xadd(self.keys.outcomes, outcome, maxlen=self.settings.outcomes_maxlen, approximate=True)
        for entry_id, fields, reason in dead:
            record = DeadLetter.record(entry_id, fields, reason, time.time())
            pipe.xadd(self.keys.dead_letter, record, maxlen=self.settings.dead_letter_maxlen, approximate=True)
        replies = pipe.execute(raise_on_error=False)
        if items and isinstance(replies[0], NoScriptError):  # ran nothing: the text loads it and runs it
            self._index(keys=keys, args=args)
            replies = replies[1:]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply

    def load_scripts(self) -> None:
        """Load the scripts sent by digest into a Redis that lost them (a restart, failover, flush)."""
        for script in (self._apply, self._record_steps, self._index, self._enqueue_planned):
            script.load()
        self._loaded = True

    def settle(self, views: list[WorkflowView], ack: list[bytes]) -> None:
        """After `follow_up` succeeded: empty the outboxes it wrote out, and acknowledge the entries."""
        self.settle_commands_now(self.settle_commands(views, ack))

    def settle_commands_now(self, commands: list[tuple[Any, ...]]) -> None:
        """Send what `settle_commands` returned, in one round trip; raises on an error reply."""
        if not commands:
            return
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                raise reply

    def settle_and_read(self, commands: list[tuple[Any, ...]], consumer: str, count: int, block_ms: int) -> Any:
        """Send what `settle_commands` returned, then the consumer's blocking read of new entries,
        in one round trip; the read's reply (redis-py's XREADGROUP shape). An error reply to any
        of the settle commands raises, after the read: the entries it named come back, and fold
        to no change."""
        pipe = self.redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        pipe.xreadgroup(self.keys.group, consumer, {self.keys.events: ">"}, count=count, block=block_ms)
        *settled, read = pipe.execute(raise_on_error=False)
        for reply in (*settled, read):
            if isinstance(reply, Exception):
                raise reply
        return read

    def settle_commands(self, views: list[WorkflowView], ack: list[bytes]) -> list[tuple[Any, ...]]:
        """What `settle` sends, for a caller that sends it later, with its next write."""
        commands: list[tuple[Any, ...]] = []
        for view in views:
            for raw in view.outbox:
                commands.append(
                    ("LREM", self.keys.outbox(view.workflow), 1, raw)
                )  # by value: a second writer removes nothing
        if ack:
            commands.append(("XACK", self.keys.events, self.keys.group, *ack))
        return commands

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
