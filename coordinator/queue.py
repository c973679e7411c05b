"""The RQ side of dispatch: how a compensation becomes a job on queue `saga`.

The coordinator calls `enqueue`; workers run `mcp_saga.workers.job.compensate`. Job ids come from the
compensation's idempotency key and dispatch number, and enqueueing is `unique`, so a coordinator
that crashed after its state transition and replays the event cannot queue the same dispatch
twice (RQ would otherwise overwrite the job and run it twice).
"""

from __future__ import annotations

import math
import random
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
from mcp_saga.schemas.config import WorkerSettings
from mcp_saga.schemas.records import JOB_FUNCTION, CompensationJob
from redis import Redis
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError


def backoff_intervals(settings: WorkerSettings, rng: random.Random | None = None) -> list[int]:
    """Exponential backoff with jitter, one interval per retry, bounded by `backoff_max`.

    RQ takes whole seconds; jitter spreads the retries of many compensations that failed
    together (a server that was down) so they do not return in one burst.
    """
    rng = rng or random.Random()
    return [round(settings.backoff(retry, rng.uniform(-1, 1))) for retry in range(settings.attempts - 1)]


def queue_for(connection: Redis, name: str) -> Queue:
    return Queue(name, connection=connection)


def enqueue(queue: Queue, job: CompensationJob, settings: WorkerSettings) -> bool:
    """Queue one dispatch of a compensation; False when that dispatch is already queued or ran.

    A re-dispatch continues the compensation's budget: it gets only the attempts (and the later,
    longer backoff intervals) that earlier dispatches left unused, so a slow server is called at
    most `attempts` times per compensation, however often the watchdog steps in.
    """
    retries = max(0, settings.attempts - 1 - job.attempts_used)
    intervals = backoff_intervals(settings)[settings.attempts - 1 - retries :]
    retry = Retry(max=retries, interval=intervals) if retries else None
    options: dict[str, Any] = {
        "job_id": job.job_id,
        "unique": True,
        "retry": retry,
        "job_timeout": settings.job_timeout,
        "result_ttl": 3600,
        "failure_ttl": 7 * 86_400,
        "description": f"compensate {job.workflow}/{job.step}: {job.server}:{job.operation_id}",
        "meta": {"workflow": job.workflow, "step": job.step},
    }
    try:
        # A backoff to wait out first: RQ's scheduler releases it. RQ keeps whole seconds (it drops
        # the fraction, which would cut the wait short): so the next whole second.
        if (due := math.ceil(job.not_before)) > time.time():
            queue.enqueue_at(datetime.fromtimestamp(due, UTC), JOB_FUNCTION, job_payload(job), **options)
        else:
            queue.enqueue(JOB_FUNCTION, job_payload(job), **options)
    except DuplicateJobError:
        return False
    return True


def job_payload(job: CompensationJob) -> str:
    """JSON text (not a pickle): readable in rq-dashboard and by workers of any version."""
    return msgspec.json.encode(job).decode()
