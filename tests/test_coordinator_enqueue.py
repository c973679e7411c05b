"""The coordinator's dispatch (coordinator/queue.py `enqueue_all`): a batch's due jobs in one round
trip, written so that RQ itself reads them as its own enqueue would have left them.

A real redis-server; a plain RQ `SimpleWorker` (RQ's own path, not ours) runs what was queued.
"""

from __future__ import annotations

import time
from datetime import datetime

import msgspec
import redis
import redis.connection
from mcp_saga.coordinator.queue import RQ_TIMESTAMP, JobHash, _options, _retries, enqueue, enqueue_all, job_payload
from mcp_saga.schemas.config import WorkerSettings
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import JOB_FUNCTION, CompensationJob, idempotency_key
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry

K = Keys()
SETTINGS = WorkerSettings(attempts=3)


def job(n: int, dispatch: int = 1, **changes: object) -> CompensationJob:
    workflow = f"enq-{n}"
    planned = CompensationJob(
        workflow=workflow, step="s", server="trivial", tool="noop", operation_id="noop_undo", arguments={"n": n},
        idempotency_key=idempotency_key(workflow, "s", "noop_undo"), dispatch=dispatch,
    )  # fmt: skip
    return msgspec.structs.replace(planned, **changes)


def round_trips(r: redis.Redis, run: object) -> int:
    """How many times `run()` sent something to Redis (a pipeline is one send)."""
    count = 0
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: object, *args: object, **kwargs: object) -> object:
        nonlocal count
        count += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    redis.connection.AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
    try:
        run()  # type: ignore[operator]
    finally:
        redis.connection.AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
    return count


def test_a_batch_of_jobs_goes_out_in_one_round_trip_in_order(r: redis.Redis) -> None:
    queue = Queue(K.queue, connection=r)
    assert enqueue(queue, job(100), SETTINGS)  # a running coordinator's: the script loaded, the version known
    jobs = [job(n) for n in range(5)]
    replies: list[bool] = []
    assert round_trips(r, lambda: replies.extend(enqueue_all(queue, jobs, SETTINGS))) == 1
    assert replies == [True] * 5
    assert queue.get_job_ids()[1:] == [j.job_id for j in jobs]
    assert r.sismember("rq:queues", queue.key)


def test_rq_reads_the_job_as_its_own_enqueue_writes_it(r: redis.Redis) -> None:
    queue = Queue(K.queue, connection=r)
    planned = job(1)
    assert enqueue(queue, planned, SETTINGS)
    ours = r.hgetall(f"rq:job:{planned.job_id}")
    fetched = Job.fetch(planned.job_id, connection=r)
    assert fetched.get_status() == JobStatus.QUEUED
    assert fetched.func_name == JOB_FUNCTION and fetched.args == (msgspec.json.encode(planned).decode(),)
    assert fetched.retries_left == 2 and len(fetched.retry_intervals) == 2
    assert fetched.meta == {"workflow": "enq-1", "step": "s"} and fetched.origin == K.queue
    assert fetched.timeout == SETTINGS.job_timeout and fetched.result_ttl == 3600
    # The same fields RQ's own unique enqueue writes.
    other = Queue("enq-rq", connection=r)
    rq_job = other.enqueue(JOB_FUNCTION, "x", job_id="enq-rq-1", unique=True, retry=None, meta={"a": 1})
    assert set(r.hgetall(rq_job.key)) - set(ours) == set()


def test_a_dispatch_is_queued_once(r: redis.Redis) -> None:
    queue = Queue(K.queue, connection=r)
    first, again = job(2), job(2)
    assert enqueue_all(queue, [first, job(3)], SETTINGS) == [True, True]
    assert enqueue_all(queue, [again, job(2, dispatch=2)], SETTINGS) == [False, True]
    assert queue.get_job_ids().count(first.job_id) == 1


def test_a_flushed_script_cache_is_no_lost_dispatch(r: redis.Redis) -> None:
    queue = Queue(K.queue, connection=r)
    assert enqueue(queue, job(4), SETTINGS)
    r.script_flush()  # as after a Redis restart
    replies: list[bool] = []
    assert round_trips(r, lambda: replies.extend(enqueue_all(queue, [job(5), job(4)], SETTINGS))) == 2
    assert replies == [True, False]
    assert job(5).job_id in queue.get_job_ids()


def test_a_job_with_a_backoff_is_scheduled_by_rq(r: redis.Redis) -> None:
    queue = Queue(K.queue, connection=r)
    later = job(6, not_before=time.time() + 30)
    assert enqueue_all(queue, [later, job(7)], SETTINGS) == [True, True]
    assert later.job_id in ScheduledJobRegistry(queue=queue).get_job_ids()
    assert queue.get_job_ids() == [job(7).job_id]
    assert enqueue_all(queue, [later], SETTINGS) == [False]


def test_the_job_hash_template_is_what_the_installed_rq_writes(r: redis.Redis) -> None:
    """Guard for JobHash: built from a template once, each job's hash equals RQ's own for it.

    RQ's Job.to_dict is the reference (created and prepared by RQ for the same queue, as RQ's
    enqueue does); only the two timestamps differ, by when each was taken.
    """
    queue = Queue(K.queue, connection=r)
    for settings, planned in [
        (SETTINGS, job(8)),
        (WorkerSettings(attempts=1), job(9)),
        (SETTINGS, job(10, attempts_used=2)),
    ]:
        retries, intervals = _retries(planned, settings)
        key, flat = JobHash.of(queue, settings.job_timeout).fields(planned, retries, intervals)
        ours = dict(zip(flat[::2], flat[1::2], strict=True))
        options = _options(planned, settings)
        options.pop("unique")
        options["timeout"] = options.pop("job_timeout")
        options["retry"] = Retry(max=retries, interval=intervals) if retries else None
        theirs = queue.create_job(JOB_FUNCTION, args=(job_payload(planned),), **options)
        queue._prepare_for_queue(theirs)
        reference = {
            k: v if isinstance(v, bytes | str) else str(v) for k, v in theirs.to_dict().items() if v is not None
        }
        assert key == theirs.key
        for stamp in ("created_at", "enqueued_at"):
            assert datetime.strptime(ours.pop(stamp), RQ_TIMESTAMP) and reference.pop(stamp)
        assert ours == reference
        assert ("retries_left" in ours) == bool(retries)
