"""The RQ job: perform one compensation over MCP and report every attempt on `saga:events`.

The coordinator owns workflow state; this job only reads the compensation record, holds a short
lease so that two workers never run the same compensation at once, calls the tool with the
compensation's idempotency key, and XADDs what happened. Delivery is at least once (RQ retries,
the coordinator's watchdog re-dispatches, a worker may die between the call and its report), so
the key, identical on every attempt, is what makes the effect happen once.

Retries are RQ's: a retryable failure that is not the last attempt is reported and then raised
as `RetryableFailure`, so RQ schedules the next attempt with the job's backoff; every other
outcome is reported as final and returns normally, so RQ does not retry it. Every attempt is
reported, with its dispatch and attempt numbers, so one dispatch calls the server at most
`[worker] attempts` times and the coordinator can tell a slow compensation from a silent one.

The lease is held, and refreshed by a heartbeat, from before the trust checks until the report is
written (`workers/lease.py`). A job that finds the lease held by another worker does not call the
server and does not vanish either: it is *deferred* like a job whose server is busy (below), without
counting an attempt, since the server was not called: a failover that duplicates jobs must not spend
a compensation's attempts in seconds. Its continuation usually finds the compensation settled by the
holder (then it stops) or let go of (then it calls; a holder that died lets go when its lease
expires). After HELD_DEFERRALS_MAX such deferrals (about a minute) it reports a retryable attempt
("not called: the lease is held by W") and RQ tries again after the backoff, so a holder stuck
for longer shows in the workflow's history. A success from the holder still counts after such a
report, even a final one: the coordinator takes a success from any dispatch.

Per-server isolation (issue 11, item 10): a process lets at most `[worker] per_server` of its slots
wait on one server (`SessionPool.slot`). A job whose server is at that limit is not run in a slot
that would only wait; it is *deferred*: continued as a new RQ job due a second later, with the
same payload and the attempts it has left, and without counting an attempt (the server was not
called); a job deferred again waits twice as long, up to DEFER_MAX_SECONDS. So a server that
hangs holds at most `per_server` slots, each for at most its `timeout`, and the other slots keep
serving the other servers' compensations.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
from mcp_saga.runtime import metrics, tracing
from mcp_saga.runtime.failpoints import fail_point
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.publish import clip
from mcp_saga.runtime.recovery_wire import IDEMPOTENCY_META_KEY, ToolDeclaration
from mcp_saga.runtime.sessions import SessionError, SessionPool
from mcp_saga.schemas.config import Config, WorkerSettings, load_config
from mcp_saga.schemas.events import (
    CompensationFailed,
    CompensationRefused,
    CompensationSucceeded,
    DeclarationFailed,
    DeclarationRead,
    Payload,
    RecallFailed,
    RecallSucceeded,
    StepCompleted,
    entry_fields,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import (
    SETTLED,
    Compensation,
    CompensationJob,
    arguments_digest,
    comp_decoder,
    job_decoder,
)
from mcp_saga.schemas.results import result_text
from mcp_saga.workers import trust
from mcp_saga.workers.lease import Lease, park_all, parked, queue_park, release_all
from redis import Redis
from redis.client import Pipeline
from rq import Queue, Retry, get_current_job
from rq.job import Job
from rq.timeouts import JobTimeoutException

log = get_logger("worker")

# Test-only: SIGKILL this worker right after the tool call returns, before its report.
KEY_ARGUMENTS = ("idempotencyKey", "idempotency_key")
# A report carries the compensating tool's result for the timeline; a huge one is cut to this, far
# inside the contract's MAX_DATA_BYTES, since nothing binds from it.
MAX_RESULT_BYTES = 64 * 1024

# The SDK reports an unknown tool and rejected arguments as ordinary `isError` results; these
# are the texts it uses, and no retry can change them.
_PERMANENT = re.compile(r"^(Unknown tool: |Error executing tool \S+: \d+ validation errors? for \S+Arguments)")
# A deferred job comes back 1, 2, 4, ... seconds later (RQ's scheduler looks about once a second),
# at most this much: a server hung for its whole `timeout` costs each queued job a handful of
# continuations, not one a second.
DEFER_MAX_SECONDS = 30
# How many times a job that finds its lease held is continued later before it counts an attempt:
# 1 + 2 + 4 + 8 + 16 + 30 s, longer than a holder that died keeps its lease.
HELD_DEFERRALS_MAX = 6
# How long a slip step runs on the record the job's first trip read, instead of reading it again:
# long enough for a fast unwind's steps (a few ms each) to go without a round trip between them,
# short enough that a take-back (a late step that must go first) is seen about as soon as when
# each step read for itself, whose read raced the previous call's end the same way.
SLIP_READS_HOLD = 0.25


class RetryableFailure(Exception):
    """Raised after reporting a failure that the next attempt may fix: RQ schedules that attempt."""


@dataclass
class WorkerContext:
    """What a worker process sets up once, so that no job connects anything."""

    redis: Redis
    config: Config
    pool: SessionPool
    name: str


_context: WorkerContext | None = None


def set_context(redis: Redis, config: Config, pool: SessionPool, name: str) -> None:
    global _context
    _context = WorkerContext(redis, config, pool, name)


def clear_context() -> None:
    global _context
    _context = None


def _current_context(rq_job: Job | None) -> WorkerContext:
    """The process's context; under a plain `rq worker` one is built from `SAGA_CONFIG` on first use."""
    if _context is None:
        if rq_job is None:
            raise RuntimeError("mcp_saga.workers.job.compensate runs inside an RQ worker (or after set_context)")
        config = load_config()
        if config.redis.cluster:
            raise RuntimeError(
                "with [redis] cluster = true, run `saga worker`: a plain `rq worker` knows only the queue's Redis"
            )
        log.warning("no worker context: built one from SAGA_CONFIG; `saga worker` keeps sessions warm across jobs")
        set_context(rq_job.connection, config, session_pool(config), "rq")
    assert _context is not None
    return _context


class Outbox:
    """Writes a job leaves for its next round trip: an attempt's report and lease release.

    That trip is the next slip step's reads (`_Attempt.run`), or the worker's end-of-job MULTI
    (workers/bookkeeping.py); `flush` sends them on their own: before an exception reaches RQ (a
    retry never precedes its report), and at the end of a job no worker carries them for. They stay
    until the trip that carried them succeeded, so a refused MULTI sends them again with its retry.
    """

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.writes: list[Callable[[Pipeline], None]] = []

    def add(self, write: Callable[[Pipeline], None]) -> None:
        self.writes.append(write)

    def drain(self, pipe: Pipeline) -> None:
        for write in self.writes:
            write(pipe)

    def clear(self) -> None:
        self.writes.clear()

    def flush(self) -> None:
        if not self.writes:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            self.drain(pipe)
            pipe.execute()
        self.clear()


@dataclass
class _First:
    """A job's first reads, made in the worker's start-up MULTI: its lease token and the replies
    (None when one was an error: the attempt then reads again itself, under the same token)."""

    token: str
    replies: list[Any] | None
    at: float
    # The slip's leases and whether each was parked (None: the job parks them itself).
    slip: tuple[list[Lease], list[bool]] | None = None
    # Each slip step's record (and recorded step), read in the same trip: its attempt goes without
    # a round trip of its own while they are fresh, and the step before's report rides later.
    slip_reads: list[list[Any]] | None = None
    # How long the replies are trusted (None: a third of the attempt's lease).
    hold: float | None = None

    def member(self, n: int, lease: Lease) -> _First | None:
        """What the slip's step `n` reads as its own first reads: its parked lease, its record."""
        if self.slip_reads is None or n >= len(self.slip_reads):
            return None
        return _First(lease.token, [True, None, *self.slip_reads[n]], self.at, hold=SLIP_READS_HOLD)


def first_reads(rq_job: Job, pipe: Pipeline) -> Callable[[list[Any]], None] | None:
    """Queue a compensation job's first reads (take the lease, read the record and the recorded step)
    into the worker's start-up MULTI; returns what takes their replies, or None when the job must
    read for itself (no worker context yet, a payload that does not decode: the job reports that)."""
    ctx = _context
    if ctx is None:
        return None
    try:
        job = job_decoder.decode(rq_job.args[0])
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError, TypeError):
        return None
    lease = _lease(ctx, job, rq_job.meta.get("lease_token"))
    before = len(pipe)
    _reads(_keys(ctx, job), job, lease, pipe)
    reads = len(pipe) - before
    slip = [_lease(ctx, member) for member in job.then]
    queue_park(pipe, slip, ctx.config.worker.lease)
    parks = 2 * len(slip)
    sizes = []
    for member in job.then:
        before = len(pipe)
        _records(_keys(ctx, member), member, pipe)
        sizes.append(len(pipe) - before)

    def take(replies: list[Any]) -> None:
        fine = not any(isinstance(reply, Exception) for reply in replies)
        first = _First(lease.token, replies[:reads] if fine else None, time.monotonic())
        if fine and slip:
            first.slip = (slip, parked(replies[reads : reads + parks]))
            at, first.slip_reads = reads + parks, []
            for size in sizes:
                first.slip_reads.append(replies[at : at + size])
                at += size
        rq_job._saga_first = first  # type: ignore[attr-defined]

    return take


def _reads(keys: Keys, job: CompensationJob, lease: Lease, pipe: Pipeline) -> None:
    """The lease and the record in one round trip: taking a lease we then drop costs nothing."""
    lease.take(pipe)
    _records(keys, job, pipe)


def _records(keys: Keys, job: CompensationJob, pipe: Pipeline) -> None:
    pipe.hget(keys.comp(job.workflow), job.step)
    if job.seq >= 0:  # the recorded step, which the trust checks compare the live declaration with
        pipe.lindex(keys.steps(job.workflow), job.seq)


def _keys(ctx: WorkerContext, job: CompensationJob) -> Keys:
    """Bound to the workflow's partition: the report goes to the stream its coordinators read."""
    return Keys(job.prefix, ctx.config.redis.partitions).route(job.workflow)


def _token(rq_job: Job) -> str | None:
    """The lease token a job holds or adopts: from its first reads, or parked by a deferral."""
    first: _First | None = getattr(rq_job, "_saga_first", None)
    return first.token if first is not None else rq_job.meta.get("lease_token")


def session_pool(config: Config) -> SessionPool:
    """The worker's pool: warm sessions, and at most `per_server` slots waiting on any one server."""
    return SessionPool(config.servers, tools_ttl=config.worker.tools_ttl, per_server=config.worker.slots_per_server)


def attempt_of(rq_job: Job | None, settings: WorkerSettings, used: int = 0) -> tuple[int, int]:
    """(attempt number from 1, retries left after this one), from RQ's own bookkeeping.

    RQ keeps `retries_left` but not the Retry's `max`; `enqueue` gives one interval per retry,
    so their count is the max (the configured attempts are the fallback for foreign jobs). A
    deferred job's continuation carries the attempt it starts at in `meta["first_attempt"]`; a
    re-dispatch starts after the `used` attempts earlier dispatches spent (the job's attemptsUsed).
    """
    first = int(rq_job.meta.get("first_attempt", used + 1)) if rq_job is not None else used + 1
    if rq_job is None or not rq_job.retries_left:
        planned = len(rq_job.retry_intervals or ()) if rq_job else 0
        return first + planned, 0
    left = rq_job.retries_left
    planned = next(n for n in (len(rq_job.retry_intervals or ()), settings.attempts - 1, left) if n >= left)
    return first + planned - left, left


def compensate(payload: str) -> str:
    """Perform one dispatch of one compensation; returns what happened, for `rq info` and dashboards."""
    job = job_decoder.decode(payload)
    rq_job = get_current_job()
    ctx = _current_context(rq_job)
    carried: Outbox | None = getattr(rq_job, "_saga_outbox", None)  # sent with the worker's end-of-job MULTI
    outbox = carried or Outbox(ctx.redis)
    try:
        outcome = _compensate(ctx, job, rq_job, payload, outbox)
    except BaseException:
        outbox.flush()
        raise
    if carried is None:
        outbox.flush()
    return outcome


def _compensate(ctx: WorkerContext, job: CompensationJob, rq_job: Job | None, payload: str, outbox: Outbox) -> str:
    first: _First | None = getattr(rq_job, "_saga_first", None)
    with ctx.pool.slot(job.server) as free:
        if not free and rq_job is not None:
            if first is not None and first.slip is not None:  # parked in the first trip: the continuation parks anew
                leases, ok = first.slip
                release_all([lease for lease, held in zip(leases, ok, strict=True) if held])
            return _defer(ctx, job, rq_job, payload)
        slip = _park(ctx, job.then, first.slip if first is not None else None)
        try:
            outcome = _Attempt(ctx, job, rq_job, outbox=outbox, first=first).run()
        except BaseException:
            release_all([lease for _, lease in slip])
            raise
    if not slip:
        return outcome
    return outcome + _run_slip(ctx, slip, outcome == "succeeded", outbox, first)


def _park(
    ctx: WorkerContext, then: tuple[CompensationJob, ...], done: tuple[list[Lease], list[bool]] | None = None
) -> list[tuple[CompensationJob, Lease]]:
    """Lease every step of the slip up front, so none looks silent while it waits its turn.

    The slip ends before the first step whose lease another worker holds. `done`: the leases were
    parked in the job's first round trip already (and whether each was).
    """
    if done is not None:
        leases, parked = done
    else:
        leases = [_lease(ctx, member) for member in then]
        parked = park_all(leases, ctx.config.worker.lease)
    cut = parked.index(False) if False in parked else len(leases)
    release_all([lease for lease, ok in zip(leases[cut:], parked[cut:], strict=True) if ok])
    for lease in leases[:cut]:
        lease.hold()
    return list(zip(then[:cut], leases[:cut], strict=True))


def _run_slip(
    ctx: WorkerContext,
    slip: list[tuple[CompensationJob, Lease]],
    go_on: bool,
    outbox: Outbox,
    first: _First | None = None,
) -> str:
    """Run the slip's steps in order while each succeeds; report each as its own attempt.

    Stops at the first that does not succeed (a failure, a refusal, awaiting approval) or whose
    record is no longer queued under this slip (the coordinator took it back); the steps after
    it are released, and the coordinator, the only writer, decides them anew.

    Between two steps no round trip is awaited while the reads made with the job's first trip
    hold (SLIP_READS_HOLD, within a third of a lease: the slip's leases, parked then, are surely
    still ours): step k's report and release wait in the outbox for the job's end-of-job MULTI,
    or for the first step past that window, whose trip carries them in front of its own reads
    (Redis runs them in order, so k+1 is read after k is reported). So a report is late by at
    most that window and a call, and the coordinator folds the reports after the unwind's calls
    instead of beside them.
    """
    done, left = 0, list(slip)
    try:
        for n, (member, lease) in enumerate(slip):
            outcome = ""
            if go_on:
                with ctx.pool.slot(member.server) as free:
                    if free:
                        reads = first.member(n, lease) if first is not None else None
                        outcome = _Attempt(ctx, member, None, token=lease.token, outbox=outbox, first=reads).run()
                        left.pop(0)  # the attempt released its lease (only an error skips that)
            if outcome != "succeeded":
                stopped = f"; stopped at {member.step}: {outcome or 'not run'}"
                return f"; slip: {done} of {len(slip)} succeeded{stopped if outcome or go_on else ''}"
            done += 1
        return f"; slip: {done} of {len(slip)} succeeded"
    finally:  # an error or a job timeout on the way must not leave leases renewed for steps never run
        if left:
            with ctx.redis.pipeline(transaction=False) as pipe:
                outbox.drain(pipe)
                for _, lease in left:
                    lease.release(pipe)
                pipe.execute()
            outbox.clear()


def _lease(ctx: WorkerContext, job: CompensationJob, token: str | None = None) -> Lease:
    return Lease(
        ctx.redis,
        _keys(ctx, job).lease(job.workflow, job.step),
        ctx.name,
        ctx.config.worker.lease,
        workflow=job.workflow,
        step=job.step,
        token=token,
    )


def _defer(ctx: WorkerContext, job: CompensationJob, rq_job: Job, payload: str, held_by: str | None = None) -> str:
    """Continue the job as a new one due shortly, with the attempts it has left (none was used).

    `held_by`: the job was deferred because that worker holds its lease, not for a busy server.
    """
    attempt, left = attempt_of(rq_job, ctx.config.worker, job.attempts_used)
    held = {"held": int(rq_job.meta.get("held", 0)) + 1} if held_by else {}
    intervals = list(rq_job.retry_intervals or ())
    base = rq_job.meta.get("base_id", rq_job.id)
    deferrals = int(rq_job.meta.get("deferrals", 0)) + 1
    delay = min(2 ** (deferrals - 1), DEFER_MAX_SECONDS)
    # The lease parked for the wait (plus a lease, for a scheduler a little late): a deferred job
    # is not silent, and the coordinator's short watchdog does not dispatch it again meanwhile.
    lease = _lease(ctx, job, _token(rq_job))
    parked = {"lease_token": lease.token} if lease.park(delay + ctx.config.worker.lease) else {}
    continuation = Queue(rq_job.origin, connection=rq_job.connection).enqueue_in(
        timedelta(seconds=delay),
        rq_job.func_name,
        payload,
        job_id=f"{base}-w{deferrals}",
        retry=Retry(max=left, interval=intervals[len(intervals) - left :] or [0]) if left else None,
        job_timeout=rq_job.timeout,
        result_ttl=rq_job.result_ttl,
        failure_ttl=rq_job.failure_ttl,
        description=rq_job.description,
        meta={**rq_job.meta, "first_attempt": attempt, "deferrals": deferrals, "base_id": base, **parked, **held},
    )
    why = f"the lease is held by {held_by}" if held_by else f"{job.server} is using every slot it may have"
    log.info(
        "compensation deferred",
        reason=why,
        workflow=job.workflow,
        step=job.step,
        dispatch=job.dispatch,
        attempt=attempt,
        server=job.server,
        continuation=continuation.id,
    )
    return f"deferred: {why}; continued as job {continuation.id}"


class _Attempt:
    def __init__(
        self,
        ctx: WorkerContext,
        job: CompensationJob,
        rq_job: Job | None,
        *,
        outbox: Outbox,
        token: str | None = None,
        first: _First | None = None,
    ):
        """`token`: a step of a routing slip (no RQ job of its own), under the lease parked for it.
        `outbox`: where the attempt leaves its report and release; `first`: its reads, made already."""
        self.ctx, self.job, self.keys = ctx, job, _keys(ctx, job)
        self.outbox, self.first = outbox, first
        self.in_slip = token is not None
        self.rq_job = rq_job
        if self.in_slip:  # one attempt here; a retry is the coordinator's next dispatch
            self.attempt = job.attempts_used + 1
            self.retries_left = max(0, ctx.config.worker.attempts - self.attempt)
        else:
            self.attempt, self.retries_left = attempt_of(rq_job, ctx.config.worker, job.attempts_used)
        if token is None and rq_job is not None:
            token = _token(rq_job)
        self.lease = _lease(ctx, job, token)
        self.started = time.monotonic()
        self.report: Payload | None = None
        self.traced: tracing.Attempt | None = None
        self.step_raw: bytes | None = None

    def run(self) -> str:
        job, first = self.job, self.first
        # Reads made in the worker's start-up MULTI hold while the lease's first renewal is not due.
        hold = self.lease.every if first is None or first.hold is None else min(first.hold, self.lease.every)
        if first is not None and first.replies is not None and time.monotonic() - first.at < hold:
            replies = first.replies
        else:  # the previous slip step's report and release ride in front of this step's reads
            with self.ctx.redis.pipeline(transaction=False) as pipe:
                self.outbox.drain(pipe)
                sent = len(pipe)
                _reads(self.keys, job, self.lease, pipe)
                replies = pipe.execute()[sent:]
            self.outbox.clear()
        taken, holder, raw, *step = replies
        leased = self.lease.taken((taken, holder))
        self.step_raw = step[0] if step else None
        record = comp_decoder.decode(raw) if raw else None
        skip = self._skip_reason(record)
        if skip:  # settled or superseded: the coordinator needs no word from this job
            if leased:
                self._finish()
            self._log("info", "skipped", reason=skip)
            return f"skipped: {skip}"
        if not leased:
            try:
                return self._held(holder)
            finally:
                self._finish(release=False)
        assert record is not None
        self.lease.hold()
        try:
            with tracing.attempt(job) as self.traced:
                return self._perform(record)
        finally:
            self._finish()

    def _held(self, holder: bytes | None) -> str:
        """Another worker is on this compensation: continue later without an attempt (bounded), else
        say so, and let RQ try again after the backoff."""
        name = holder.decode(errors="replace").rpartition(":")[0] if holder else ""
        who = f"worker {name}" if name else "a worker that let go of it just now"
        rq_job = self.rq_job
        if rq_job is not None and not self.in_slip and int(rq_job.meta.get("held", 0)) < HELD_DEFERRALS_MAX:
            return _defer(self.ctx, self.job, rq_job, rq_job.args[0], held_by=who)
        return self._failed(f"not called: the lease is held by {who}, which is on it", True)

    def _skip_reason(self, record: Compensation | None) -> str | None:
        if record is None:
            return "no compensation record (the workflow expired or was never planned)"
        if record.status in SETTLED:
            return f"already {record.status}"
        if record.dispatch > self.job.dispatch:
            return f"stale dispatch {self.job.dispatch}; the record is at dispatch {record.dispatch}"
        if record.kind != self.job.kind:  # a recall overtaken by the step's own result, or the reverse
            return f"superseded: the record plans a {record.kind} now, not a {self.job.kind}"
        if self.in_slip and (record.status != "queued" or record.dispatch != self.job.dispatch):
            return f"taken back from the routing slip (the record is {record.status}, dispatch {record.dispatch})"
        return None

    def _perform(self, record: Compensation) -> str:
        if self.job.kind == "declaration":
            return self._read_declaration(record)
        job, pool = self.job, self.ctx.pool
        try:
            refusal, tools = self._vet(record)
            if refusal is not None:
                payload = CompensationRefused(**self._fields(final=True), status=refusal.status, reason=refusal.reason)
                self._report(payload)
                self._log("warning", "refused", status=refusal.status, reason=refusal.reason)
                return f"refused: {refusal.status}: {refusal.reason}"
            declaration = tools[job.operation_id]
            arguments = self._arguments(declaration) if job.kind == "compensation" else dict(job.arguments)
            missing = [name for name in declaration.input_schema.get("required", []) if name not in arguments]
            if missing:
                return self._failed(f"{job.operation_id}: missing required arguments: {', '.join(missing)}", False)
            # The attempt's W3C trace context travels in `_meta` too (`traceparent`, `tracestate`).
            meta = {IDEMPOTENCY_META_KEY: job.idempotency_key, **(self.traced.carrier if self.traced else {})}
            timeout = self.ctx.config.servers[job.server].timeout
            self.started = time.monotonic()  # from here on, the duration is the call's
            result = pool.call_tool(job.server, job.operation_id, arguments, meta, timeout)
        except SessionError as exc:
            return self._failed(str(exc), exc.retryable)
        except JobTimeoutException:  # RQ's job_timeout cut the attempt short: report it like a call timeout
            return self._failed("the RQ job timeout ran out during the attempt", True)
        fail_point("worker.after-call")
        if job.kind == "recall":  # any answer settles the step, an error one included (nothing to undo)
            self._report(RecallSucceeded(**self._fields(final=True), result=result))
            self._log("info", "recalled", duration_ms=self._elapsed_ms(), is_error=bool(result.get("isError")))
            return "recalled"
        if result.get("isError"):
            text = result_text(result, "\n") or "isError result without text"
            return self._failed(text, not _PERMANENT.match(text))
        self._report(CompensationSucceeded(**self._fields(final=True), result=_bounded(result)))
        self._log("info", "succeeded", duration_ms=self._elapsed_ms())
        return "succeeded"

    def _read_declaration(self, record: Compensation) -> str:
        """A `declaration` job: list the step's server live and report the tool's declaration.

        Nothing is called: the coordinator plans the step from the report (the operator's overlay
        first) as if its event had carried that declaration. The listing is asked for afresh, not
        taken from the cache, since the plan is the server's word as of now.
        """
        job = self.job
        refusal = trust.check_request(job, record, self.ctx.config)
        if refusal is not None:
            return self._failed(f"refused: {refusal.reason}", False)
        try:
            self.started = time.monotonic()
            tools = self.ctx.pool.tools(job.server, refresh=True)
        except SessionError as exc:
            return self._failed(f"tools/list: {exc}", exc.retryable)
        except JobTimeoutException:
            return self._failed("the RQ job timeout ran out during tools/list", True)
        declaration = tools.get(job.operation_id)
        annotations = (
            {k: v for k, v in declaration.annotations.items() if k != "recovery"} if declaration is not None else None
        )
        recovery = declaration.recovery if declaration is not None else None
        listed = declaration is not None
        report = DeclarationRead(
            **self._fields(final=True), recovery=recovery, annotations=annotations, listed=listed, listed_at=time.time()
        )
        self._report(report)
        self._log("info", "declaration read", listed=listed, declared=recovery is not None)
        return f"declaration read: {'declared' if recovery is not None else 'none declared'}"

    def _vet(self, record: Compensation) -> tuple[trust.Refusal | None, dict[str, ToolDeclaration]]:
        """Trust checks; the server is asked for its tools only once the request itself passes."""
        job, config, pool = self.job, self.ctx.config, self.ctx.pool
        refusal = trust.check_request(job, record, config)
        if refusal is not None:
            return refusal, {}
        raw = self.step_raw
        if job.seq != record.seq:  # a job from before `seq` was carried: read the step now
            raw = self.ctx.redis.lindex(self.keys.steps(job.workflow), record.seq)
        entry = msgspec.json.decode(raw) if raw is not None else None
        if job.kind == "recall":
            intent = entry if isinstance(entry, dict) else None

            def check(tools: dict[str, ToolDeclaration]) -> trust.Refusal | None:
                return trust.check_recall_live(job, config, tools, intent)
        else:
            step = _recorded_step(entry)

            def check(tools: dict[str, ToolDeclaration]) -> trust.Refusal | None:
                return trust.check_live(job, record, config, tools, step)

        tools = pool.tools(job.server)
        refusal = check(tools)
        if refusal is not None:  # the cached listing may predate a change on the server: ask once more
            tools = pool.tools(job.server, refresh=True)
            refusal = check(tools)
        return refusal, tools

    def _arguments(self, declaration: ToolDeclaration) -> dict[str, Any]:
        """The resolved arguments, plus the key where the tool's schema has a place for it."""
        arguments = dict(self.job.arguments)
        for name in KEY_ARGUMENTS:
            if declaration.declares_argument(name):
                arguments.setdefault(name, self.job.idempotency_key)
        return arguments

    def _failed(self, error: str, retryable: bool) -> str:
        final = not retryable or self.retries_left == 0
        kind = _FAILED_REPORTS[self.job.kind]
        report = kind(**self._fields(final=final), error=clip(error), retryable=retryable)
        self._report(report)
        self._log("warning" if final else "info", "failed", retryable=retryable, final=final, error=clip(error))
        if not final and not self.in_slip:
            raise RetryableFailure(error)
        return f"failed: {error[:200]}"

    def _fields(self, *, final: bool) -> dict[str, Any]:
        job = self.job
        return {
            "step": job.step,
            "dispatch": job.dispatch,
            "attempt": self.attempt,
            "final": final,
            "server": job.server,
            "operation_id": job.operation_id,
            "idempotency_key": job.idempotency_key,
            "arguments_digest": arguments_digest(job.arguments),
            "duration_ms": self._elapsed_ms(),
            "worker": self.ctx.name,
            "trace": self.traced.wire() if self.traced else None,
        }

    def _elapsed_ms(self) -> float:
        return round((time.monotonic() - self.started) * 1000, 3)

    def _report(self, payload: Payload) -> None:
        """Written by `_finish`, before RQ sees the outcome: a retry never precedes its report."""
        self.report = payload
        metrics.reported(payload)
        if self.traced is not None:
            self.traced.outcome(payload)

    def _finish(self, *, release: bool = True) -> None:
        """The report, then the lease release, left in the outbox for the job's next round trip."""
        report, lease, events, workflow = self.report, self.lease, self.keys.events, self.job.workflow
        if report is None and not release:
            return

        def write(pipe: Pipeline) -> None:
            if report is not None:
                pipe.xadd(events, entry_fields(workflow, report))  # type: ignore[arg-type]
            if release:
                lease.release(pipe)

        self.outbox.add(write)

    def _log(self, level: str, event: str, **fields: Any) -> None:
        job = self.job
        getattr(log, level)(
            f"compensation {event}",
            workflow=job.workflow,
            step=job.step,
            dispatch=job.dispatch,
            attempt=self.attempt,
            server=job.server,
            operation=job.operation_id,
            **fields,
        )


# The report of a failed attempt, by the job's kind.
_FAILED_REPORTS: dict[str, type[CompensationFailed | RecallFailed | DeclarationFailed]] = {
    "compensation": CompensationFailed,
    "recall": RecallFailed,
    "declaration": DeclarationFailed,
}


def _recorded_step(entry: Any) -> StepCompleted | None:
    """The stack entry as a step: a started step's intent (no result yet) reads as one with an empty result."""
    if not isinstance(entry, dict):
        return None
    if "forwardKey" in entry and "result" not in entry:
        entry = {**entry, "result": {}}
    return msgspec.convert(entry, StepCompleted)


def _bounded(result: dict[str, Any]) -> dict[str, Any]:
    """The result as reported; a huge one is cut down so that the report stays within the contract."""
    size = len(msgspec.json.encode(result))
    if size <= MAX_RESULT_BYTES:
        return result
    return {"isError": False, "truncated": True, "bytes": size, "text": clip(result_text(result, "\n"))}
