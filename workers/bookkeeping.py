"""RQ's bookkeeping of a compensation job in two round trips of its own instead of eleven.

A profile of RQ's `SimpleWorker` (3.0) running compensation jobs counted 14 Redis round trips per
job, 11 of them RQ's: the worker's idle state written before the dequeue and after the job, the
suspension check, the dequeue and the job's fetch, the execution, then the job's start in a second
MULTI, a job heartbeat after its end, a WATCH and a read of its dependents, the success MULTI. On
a worker's two shared cores each trip is two context switches and a GIL hand-over between its
threads, so trips cost CPU, not just latency. For a compensation job (`JOB_FUNCTION`, which the
coordinator enqueues without dependencies, callbacks, repeats or rate limits) this worker writes
what RQ writes in fewer trips:

- **start**, one MULTI: the execution and the started registry, the worker's state and heartbeat,
  the job's status, start and worker, its removal from the intermediate queue, and, when the job's
  state Redis is the queue's (`carry`), the job's own first reads (its lease and record,
  `workers/job.py` `first_reads`);
- **end**, one MULTI: the job's report and lease release (left by the job in its `Outbox`), the
  result and the finished registry, the job's status, end and TTL, the worker's counters and idle
  state, the execution's removal.

What is dropped is what no one reads for these jobs: the whole job hash written again on success
(only its status and end changed), the job's heartbeat between its end and its result (it covers
callbacks, and these jobs have none), the WATCH and read of dependents that cannot exist, EXPIREs
of dependents' keys that do not exist, a state write that changes nothing, and the suspension
check before every dequeue (here at most every SUSPENSION_CHECK_EVERY seconds: `rq suspend` takes
that long to be noticed). `rq info`, rq-dashboard and RQ's registries read the same keys as ever:
a killed worker's job is still in the started registry and goes to the failed one. Any other job
takes RQ's own path.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import rq.serializers
from mcp_saga.schemas.records import JOB_FUNCTION
from mcp_saga.workers.job import Outbox, first_reads
from rq import SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.utils import now, utcformat
from rq.worker import WorkerStatus

# Seconds between two looks at RQ's suspension flag (`rq suspend`), and the worker heartbeat riding on them.
SUSPENSION_CHECK_EVERY = 1.0
# RQ's modules that resolve a serializer whenever they build a Job, Queue, registry or Result.
RQ_SERIALIZER_USERS = ("rq.job", "rq.queue", "rq.registry", "rq.results", "rq.scheduler", "rq.worker.base")


def remember_serializers() -> None:
    """Point RQ's serializer resolution at one that remembers its answers (idempotent).

    RQ resolves the serializer each time it builds a Job, Queue, registry or Result, twelve times
    a compensation job, and each resolution is an `isinstance` against a runtime-checkable
    Protocol: 12 µs on Python 3.11, whose typing walks the protocol's members on every check, so
    some 145 µs of a job's CPU. The answer for a given serializer never changes (the object itself,
    or the one a name or None stands for), so it is kept; what RQ refuses still raises, each time.
    """
    original = rq.serializers.resolve_serializer
    if getattr(original, "remembers", False):
        return
    known: dict[Any, Any] = {}

    def resolve_serializer(serializer: Any = None) -> Any:
        try:
            return known[serializer]
        except KeyError:
            found = known[serializer] = original(serializer)
            return found
        except TypeError:  # an unhashable serializer object: as RQ does it
            return original(serializer)

    resolve_serializer.remembers = True  # type: ignore[attr-defined]
    rq.serializers.resolve_serializer = resolve_serializer
    for name in RQ_SERIALIZER_USERS:
        module = importlib.import_module(name)
        if getattr(module, "resolve_serializer", None) is original:
            module.resolve_serializer = resolve_serializer  # type: ignore[attr-defined]


def lean(job: Job) -> bool:
    """A job the trimmed bookkeeping is for: ours, with none of the RQ features it skips."""
    return (
        job.func_name == JOB_FUNCTION
        and not job._dependency_ids
        and not job._success_callback_name
        and not job._failure_callback_name
        and not getattr(job, "repeats_left", None)
        and not getattr(job, "rate_limit_key", None)
    )


class LeanWorker(SimpleWorker):
    """A `SimpleWorker` with the bookkeeping of compensation jobs in one MULTI at each end.

    `carry`: the jobs' state Redis is this worker's queue Redis, so the job's first reads and last
    writes ride in those MULTIs too (run_worker sets it).
    """

    carry = False
    _prepared: str | None = None
    _suspension_checked = float("-inf")

    def check_for_suspension(self, burst: bool) -> None:
        if time.monotonic() - self._suspension_checked < SUSPENSION_CHECK_EVERY:
            return
        super().check_for_suspension(burst)
        self._suspension_checked = time.monotonic()

    def set_state(self, state: str, pipeline: Any = None) -> None:
        if pipeline is None and state == self._state:  # the end-of-job MULTI wrote it already
            return
        super().set_state(state, pipeline)

    def prepare_execution(self, job: Job) -> Execution:
        """RQ's `prepare_execution` and `prepare_job_execution` in one MULTI (and the job's first reads)."""
        if not lean(job):
            return super().prepare_execution(job)
        ttl = self.get_heartbeat_ttl(job)
        with self.connection.pipeline() as pipe:
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            self.set_state(WorkerStatus.BUSY, pipeline=pipe)
            self.heartbeat(ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)  # its last_heartbeat too
            pipe.persist(job.key)
            if len(self.queues) == 1:  # as perform_job decides it
                pipe.lrem(Queue(job.origin, connection=self.connection).intermediate_queue_key, 1, job.id)
            ours = len(pipe)
            reads = first_reads(job, pipe) if self.carry else None
            replies = pipe.execute(raise_on_error=False)
        for reply in replies[:ours]:
            if isinstance(reply, Exception):
                raise reply
        self.executions[execution.id] = execution
        if reads is not None:
            reads(replies[ours:])
        if self.carry:
            job._saga_outbox = Outbox(self.connection)  # type: ignore[attr-defined]
        self._prepared = job.id
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        if self._prepared == job.id:  # written with the execution
            self.procline(f"Processing {job.func_name} from {job.origin} since {time.time()}")
            return
        super().prepare_job_execution(job, remove_from_intermediate_queue)

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        if not lean(job):
            return super().handle_execution_ended(job, queue, heartbeat_ttl)
        job.ended_at = now()  # written by the end-of-job MULTI; no callback to keep the job alive for

    def handle_job_success(self, job: Job, queue: Queue, started_job_registry: Any, execution: Execution) -> None:
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if not lean(job) or result_ttl == 0:
            return super().handle_job_success(job, queue, started_job_registry, execution)
        outbox: Outbox | None = getattr(job, "_saga_outbox", None)
        assert job.started_at is not None and job.ended_at is not None
        with self.connection.pipeline() as pipe:
            if outbox is not None:  # the report first, in the same MULTI as the job's end
                outbox.drain(pipe)
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
            job._status = JobStatus.FINISHED
            pipe.hset(job.key, mapping={"status": JobStatus.FINISHED, "ended_at": utcformat(job.ended_at)})
            Result.create(
                job,
                Result.Type.SUCCESSFUL,
                return_value=job._result,
                ttl=result_ttl,
                worker_name=self.name,
                pipeline=pipe,
                execution_id=execution.id,
                execution_started_at=execution.created_at,
                execution_ended_at=job.ended_at,
            )
            job.finished_job_registry.add(job, result_ttl, pipe)
            if result_ttl > 0:
                pipe.expire(job.key, result_ttl)
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            pipe.execute()
        if outbox is not None:
            outbox.clear()
        took = job.ended_at - job.started_at
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id, took, self.name)

    def handle_job_failure(
        self, job: Job, queue: Queue, started_job_registry: Any = None, exc_string: str = "", execution: Any = None
    ) -> None:
        # The job flushes its outbox before it raises; what is left was written after it returned.
        outbox: Outbox | None = getattr(job, "_saga_outbox", None)
        if outbox is not None:
            outbox.flush()
        super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)
