"""The RQ side of dispatch: how a compensation becomes a job on queue `saga`.

The coordinator calls `enqueue`; workers run `mcp_saga.workers.job.compensate`. Job ids come from the
compensation's idempotency key and dispatch number, and enqueueing is `unique`, so a coordinator
that crashed after its state transition and replays the event cannot queue the same dispatch
twice (RQ would otherwise overwrite the job and run it twice).

A batch's due jobs go out in one round trip (`enqueue_all`): RQ's `enqueue(unique=True)` sends the
queue's SADD and its unique-enqueue script as two trips per job, and a failing workflow's first
compensation waits for both. The job's hash is RQ's own: a template RQ built (`Queue.create_job`,
prepared as RQ prepares it) once per queue and timeout, with the fields that differ per job put in
as RQ serializes them (JobHash; a test holds it equal to RQ's own to_dict for the installed RQ), written
by RQ's own script (rq.scripts: EXISTS, HSET, RPUSH, atomically), so `rq info`, the dashboard and
RQ's registries see exactly what RQ's enqueue would have left. Building the job through RQ each
time cost more than the round trip on the path from a failure to its first compensation.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
import zlib
from datetime import UTC, datetime
from typing import Any

import msgspec
from mcp_saga.schemas.config import WorkerSettings
from mcp_saga.schemas.records import JOB_FUNCTION, CompensationJob
from redis import Redis
from redis.exceptions import NoScriptError
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError
from rq.job import Job
from rq.scripts import UNIQUE_ENQUEUE_SCRIPT

_UNIQUE_SHA = hashlib.sha1(UNIQUE_ENQUEUE_SCRIPT.encode()).hexdigest()
# One generator for the jitter: a `random.Random()` per job seeds itself from the OS each time.
_JITTER = random.Random()
RESULT_TTL = 3600
FAILURE_TTL = 7 * 86_400
# RQ's job timestamps (rq.utils.utcformat).
RQ_TIMESTAMP = "%Y-%m-%dT%H:%M:%S.%fZ"


def backoff_intervals(settings: WorkerSettings, rng: random.Random | None = None) -> list[int]:
    """Exponential backoff with jitter, one interval per retry, bounded by `backoff_max`.

    RQ takes whole seconds; jitter spreads the retries of many compensations that failed
    together (a server that was down) so they do not return in one burst.
    """
    rng = rng or _JITTER
    return [round(settings.backoff(retry, rng.uniform(-1, 1))) for retry in range(settings.attempts - 1)]


def queue_for(connection: Redis, name: str) -> Queue:
    return Queue(name, connection=connection)


def enqueue(queue: Queue, job: CompensationJob, settings: WorkerSettings) -> bool:
    """Queue one dispatch of a compensation; False when that dispatch is already queued or ran."""
    return enqueue_all(queue, [job], settings)[0]


def enqueue_all(queue: Queue, jobs: list[CompensationJob], settings: WorkerSettings) -> list[bool]:
    """Queue each dispatch, the due ones in one round trip; False where that dispatch is already queued or ran.

    A re-dispatch continues the compensation's budget: it gets only the attempts (and the later,
    longer backoff intervals) that earlier dispatches left unused, so a slow server is called at
    most `attempts` times per compensation, however often the watchdog steps in.
    """
    queued: dict[int, bool] = {}
    due: list[tuple[int, tuple[Any, ...]]] = []
    hashes: JobHash | None = None
    for n, job in enumerate(jobs):
        if not is_due(job):  # a backoff to wait out first: RQ's scheduler releases it, on a whole second
            try:
                queue.enqueue_at(
                    datetime.fromtimestamp(math.ceil(job.not_before), UTC),
                    JOB_FUNCTION,
                    job_payload(job),
                    **_options(job, settings),
                )
                queued[n] = True
            except DuplicateJobError:
                queued[n] = False
            continue
        hashes = hashes or JobHash.of(queue, settings.job_timeout)
        due.append((n, unique_call(queue, job, settings, hashes)))
    if due:
        calls = dict(due)
        load = False
        while calls:  # twice at most: a restarted or flushed Redis answers NOSCRIPT, and ran nothing
            with queue.connection.pipeline(transaction=False) as pipe:
                if load:
                    pipe.script_load(UNIQUE_ENQUEUE_SCRIPT)
                pipe.sadd(queue.redis_queues_keys, queue.key)
                for call in calls.values():
                    pipe.execute_command("EVALSHA", _UNIQUE_SHA, 2, *call)
                replies = pipe.execute(raise_on_error=False)[1 + load :]
            for n, ok in zip(list(calls), replies, strict=True):
                if isinstance(ok, NoScriptError) and not load:
                    continue
                if isinstance(ok, Exception):
                    raise ok
                queued[n] = bool(ok)
                del calls[n]
            load = True
    return [queued[n] for n in range(len(jobs))]


def is_due(job: CompensationJob) -> bool:
    """Whether the job goes on the queue now, not through RQ's scheduler (a backoff to wait out first).

    RQ keeps whole seconds (it drops the fraction, which would cut the wait short): a job due within
    the current second is due now."""
    return math.ceil(job.not_before) <= time.time()


def unique_call(
    queue: Queue, job: CompensationJob, settings: WorkerSettings, hashes: JobHash | None = None
) -> tuple[Any, ...]:
    """The keys and arguments of RQ's unique-enqueue script for a due job: job key, queue key, id,
    push direction, TTL, then the hash's fields (coordinator/lua/enqueue_planned.lua takes them too)."""
    hashes = hashes or JobHash.of(queue, settings.job_timeout)
    retries, intervals = _retries(job, settings)
    key, fields = hashes.fields(job, retries, intervals)
    return (key, queue.key, job.job_id, "R", -1, *fields)


def _retries(job: CompensationJob, settings: WorkerSettings) -> tuple[int, list[int]]:
    """The RQ retries this dispatch gets and their intervals: what the compensation's budget has left."""
    retries = max(0, settings.attempts - 1 - job.attempts_used)
    return retries, backoff_intervals(settings)[settings.attempts - 1 - retries :]


def _options(job: CompensationJob, settings: WorkerSettings) -> dict[str, Any]:
    """RQ's own enqueue options for the job (a scheduled one goes through RQ's enqueue_at)."""
    retries, intervals = _retries(job, settings)
    return {
        "job_id": job.job_id,
        "unique": True,
        "retry": Retry(max=retries, interval=intervals) if retries else None,
        "job_timeout": settings.job_timeout,
        "result_ttl": RESULT_TTL,
        "failure_ttl": FAILURE_TTL,
        "description": _description(job),
        "meta": _meta(job),
    }


def _description(job: CompensationJob) -> str:
    return f"compensate {job.workflow}/{job.step}: {job.server}:{job.operation_id}"


def _meta(job: CompensationJob) -> dict[str, str]:
    return {"workflow": job.workflow, "step": job.step}


class JobHash:
    """The hash RQ's unique enqueue writes for a job of ours, from a template RQ built.

    The fields that are the same for every job of a queue and timeout (callbacks, TTLs, origin,
    status...) come from a job RQ created and prepared for the queue; the ones that differ are
    put in as RQ's Job.to_dict writes them: the pickled call (zlib-compressed), the pickled meta,
    the description, the timestamps and the retries (absent without any).
    """

    _cache: dict[tuple[str, int], JobHash] = {}

    def __init__(self, queue: Queue, timeout: int) -> None:
        proto = queue.create_job(
            JOB_FUNCTION, args=("",), job_id="template", timeout=timeout, result_ttl=RESULT_TTL,
            failure_ttl=FAILURE_TTL, description="", meta={}, retry=Retry(max=1, interval=[1]),
        )  # fmt: skip
        queue._prepare_for_queue(proto)  # what RQ's enqueue sets: origin, enqueued_at, status, timeout
        self.template = {key: value for key, value in _fields(proto)}
        self.dumps = queue.serializer.dumps
        self.prefix = Job.redis_job_namespace_prefix

    @classmethod
    def of(cls, queue: Queue, timeout: int) -> JobHash:
        found = cls._cache.get((queue.key, timeout))
        if found is None:
            found = cls._cache[(queue.key, timeout)] = cls(queue, timeout)
        return found

    def fields(self, job: CompensationJob, retries: int, intervals: list[int]) -> tuple[str, list[str | bytes]]:
        """The job's key and its hash's fields, flat (name, value, ...), as RQ's script takes them."""
        stamp = datetime.now(UTC).strftime(RQ_TIMESTAMP)
        hash_ = dict(self.template)
        hash_["created_at"] = hash_["enqueued_at"] = stamp
        hash_["data"] = zlib.compress(self.dumps((JOB_FUNCTION, None, (job_payload(job),), {})))
        hash_["description"] = _description(job)
        hash_["meta"] = self.dumps(_meta(job))
        if retries:
            hash_["retries_left"], hash_["retry_intervals"] = str(retries), json.dumps(intervals)
        else:
            del hash_["retries_left"], hash_["retry_intervals"]
        return self.prefix + job.job_id, [part for pair in hash_.items() for part in pair]


def _fields(rq_job: Job) -> list[tuple[str, str | bytes]]:
    """The job's hash as RQ's unique enqueue writes it (rq.scripts: its set fields, as text)."""
    return [
        (key, value if isinstance(value, bytes | str) else str(value))
        for key, value in rq_job.to_dict().items()
        if value is not None
    ]


def job_payload(job: CompensationJob) -> str:
    """JSON text (not a pickle): readable in rq-dashboard and by workers of any version."""
    return msgspec.json.encode(job).decode()
