"""The RQ side of dispatch: how a compensation becomes a job on queue `saga`.

The coordinator calls `enqueue`; workers run `mcp_saga.workers.job.compensate`. Job ids come from the
compensation's idempotency key and dispatch number, and enqueueing is `unique`, so a coordinator
that crashed after its state transition and replays the event cannot queue the same dispatch
twice (RQ would otherwise overwrite the job and run it twice).

A batch's due jobs go out in one round trip (`enqueue_all`): RQ's `enqueue(unique=True)` sends the
queue's SADD and its unique-enqueue script as two trips per job, and a failing workflow's first
compensation waits for both. The job is RQ's own (`Queue.create_job`, prepared as RQ prepares it),
written by RQ's own script (rq.scripts: EXISTS, HSET, RPUSH, atomically), so `rq info`, the
dashboard and RQ's registries see exactly what RQ's enqueue would have left.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
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
    due: list[tuple[int, Job]] = []
    for n, job in enumerate(jobs):
        options = _options(job, settings)
        # A backoff to wait out first: RQ's scheduler releases it. RQ keeps whole seconds (it drops
        # the fraction, which would cut the wait short): so the next whole second.
        if (at := math.ceil(job.not_before)) > time.time():
            try:
                queue.enqueue_at(datetime.fromtimestamp(at, UTC), JOB_FUNCTION, job_payload(job), **options)
                queued[n] = True
            except DuplicateJobError:
                queued[n] = False
            continue
        options.pop("unique")
        options["timeout"] = options.pop("job_timeout")
        rq_job = queue.create_job(JOB_FUNCTION, args=(job_payload(job),), **options)
        queue._prepare_for_queue(rq_job)  # what RQ's enqueue sets: origin, enqueued_at, status, timeout
        due.append((n, rq_job))
    if due:
        calls = {n: (rq_job.key, queue.key, rq_job.id, "R", _ttl(rq_job), *_fields(rq_job)) for n, rq_job in due}
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


def _ttl(rq_job: Job) -> int:
    return rq_job.ttl if rq_job.ttl is not None else -1


def _options(job: CompensationJob, settings: WorkerSettings) -> dict[str, Any]:
    retries = max(0, settings.attempts - 1 - job.attempts_used)
    intervals = backoff_intervals(settings)[settings.attempts - 1 - retries :]
    return {
        "job_id": job.job_id,
        "unique": True,
        "retry": Retry(max=retries, interval=intervals) if retries else None,
        "job_timeout": settings.job_timeout,
        "result_ttl": 3600,
        "failure_ttl": 7 * 86_400,
        "description": f"compensate {job.workflow}/{job.step}: {job.server}:{job.operation_id}",
        "meta": {"workflow": job.workflow, "step": job.step},
    }


def _fields(rq_job: Job) -> list[str | bytes]:
    """The job's hash as RQ's unique enqueue writes it (rq.scripts: its set fields, as text)."""
    fields: list[str | bytes] = []
    for key, value in rq_job.to_dict().items():
        if value is not None:
            fields += (key, value if isinstance(value, bytes | str) else str(value))
    return fields


def job_payload(job: CompensationJob) -> str:
    """JSON text (not a pickle): readable in rq-dashboard and by workers of any version."""
    return msgspec.json.encode(job).decode()
