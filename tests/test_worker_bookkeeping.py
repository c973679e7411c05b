"""RQ's bookkeeping of a compensation job, trimmed (workers/bookkeeping.py): what RQ's tools read
is still written, in fewer round trips, and a job cut short still lands in RQ's registries.

A real redis-server and the trivial example server over stdio; the worker runs in this process so
that its round trips can be counted (one `send_packed_command` per trip, a pipeline's included).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import redis
import redis.connection
from mcp_saga.coordinator.queue import enqueue
from mcp_saga.examples import TRIVIAL
from mcp_saga.schemas.config import Config, ServerConfig, WorkerSettings
from mcp_saga.schemas.events import decode_entry
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import Compensation, CompensationJob, comp_decoder, comp_encoder, idempotency_key
from mcp_saga.workers import job as job_module
from mcp_saga.workers.process import SagaWorker
from processes import REPO
from rq import Queue, Worker
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, FinishedJobRegistry, StartedJobRegistry

K = Keys()


def plan(r: redis.Redis, n: int, then: tuple[str, ...] = (), attempts: int = 5) -> CompensationJob:
    """A queued record and its job, as the coordinator leaves them; `then`: the steps of its slip."""
    workflow = f"book-{n}"
    members = []
    for seq, step in enumerate(["s", *then], start=1):
        key = idempotency_key(workflow, step, "noop_undo")
        record = Compensation(
            step=step, seq=seq, server="trivial", tool="noop", status="queued", operation_id="noop_undo",
            arguments={"n": n}, idempotency_key=key, source="server", dispatch=1,
        )  # fmt: skip
        r.hset(K.comp(workflow), step, comp_encoder.encode(record))
        member = CompensationJob(
            workflow=workflow, step=step, seq=seq, server="trivial", tool="noop", operation_id="noop_undo",
            arguments={"n": n}, idempotency_key=key, dispatch=1,
        )  # fmt: skip
        members.append(member)
    first, *rest = members
    job = msgspec.structs.replace(first, then=tuple(rest))
    assert enqueue(Queue(K.queue, connection=r), job, WorkerSettings(attempts=attempts))
    return job


@pytest.fixture
def worker(r: redis.Redis) -> Iterator[SagaWorker]:
    """A worker of `saga worker`'s kind with its context set, warm on the trivial server."""
    config = Config(servers={"trivial": ServerConfig(command=[sys.executable, "-m", TRIVIAL], cwd=str(REPO))})
    pool = job_module.session_pool(config)
    worker = SagaWorker([Queue(K.queue, connection=r)], connection=r, name="book-1")
    worker.carry = True
    job_module.set_context(r, config, pool, worker.name)
    worker.register_birth()
    try:
        run_one(worker, plan(r, 0))  # sessions and tool listings warm
        yield worker
    finally:
        worker.register_death()
        job_module.clear_context()
        pool.close()


def run_one(worker: SagaWorker, job: CompensationJob) -> Job:
    found = worker.dequeue_job_and_maintain_ttl(None)
    assert found is not None
    rq_job, queue = found
    assert rq_job.id == job.job_id
    worker.execute_job(rq_job, queue)
    return rq_job


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Round trips to Redis from this process, counted from when the test reads it."""
    sent = [0]
    real = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent[0] += 1
        real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return sent


def reports(r: redis.Redis, workflow: str) -> list[Any]:
    events = (decode_entry(entry_id.decode(), fields) for entry_id, fields in r.xrange(K.events))
    return [(event.type, event.data.step) for event in events if event.workflow == workflow]


def test_a_compensation_job_is_four_round_trips_and_rq_reads_what_it_always_read(
    r: redis.Redis, worker: SagaWorker, trips: list[int]
) -> None:
    job = plan(r, 1)
    trips[0] = 0
    rq_job = run_one(worker, job)
    # The dequeue and the fetch (RQ's), the start and the end: the job's own reads and report ride along.
    assert trips[0] == 4
    assert reports(r, "book-1") == [("compensation-succeeded", "s")]
    assert not r.exists(K.lease("book-1", "s"))

    stored = Job.fetch(rq_job.id, connection=r)
    assert stored.get_status() == JobStatus.FINISHED and stored.return_value() == "succeeded"
    assert stored.started_at and stored.ended_at and stored.ended_at >= stored.started_at
    assert stored.worker_name == "book-1"
    assert 0 < r.ttl(stored.key) <= 3600  # the coordinator's result_ttl
    queue = Queue(K.queue, connection=r)
    assert rq_job.id in FinishedJobRegistry(queue=queue) and rq_job.id not in StartedJobRegistry(queue=queue)
    assert not r.keys("rq:execution:*") and not r.smembers(f"rq:worker:{worker.name}:executions")
    [listed] = Worker.all(queue=queue)  # what `rq info` lists
    assert listed.name == "book-1" and listed.get_state() == "idle"
    assert listed.successful_job_count == 2 and listed.total_working_time > 0


def test_a_slip_awaits_no_round_trip_between_two_steps(r: redis.Redis, worker: SagaWorker, trips: list[int]) -> None:
    job = plan(r, 2, then=("t0", "t1", "t2"))
    trips[0] = 0
    run_one(worker, job)
    # 4 as above: the slip's leases parked and its records read in the first, its reports in the last.
    assert trips[0] == 4
    assert reports(r, "book-2") == [("compensation-succeeded", s) for s in ("s", "t0", "t1", "t2")]
    assert not r.keys(K.lease("book-2", "*"))


@pytest.mark.parametrize("age", [3600, job_module.SLIP_READS_HOLD + 0.05], ids=["hour", "just-past-the-hold"])
def test_a_slip_step_past_the_first_reads_window_reads_again_and_sees_a_take_back(
    r: redis.Redis, worker: SagaWorker, trips: list[int], monkeypatch: pytest.MonkeyPatch, age: float
) -> None:
    """Reads older than SLIP_READS_HOLD (well inside a third of the lease) are not trusted: the step
    reads its record itself, the reports before it riding in front, and a step the coordinator took
    back meanwhile (a late step that must go first, say) is not run."""
    job = plan(r, 5, then=("t0", "t1"))
    taken_back = msgspec.structs.replace(comp_decoder.decode(r.hget(K.comp("book-5"), "t1")), status="pending")
    member = job_module._First.member

    def stale(self: Any, n: int, lease: Any) -> Any:
        found = member(self, n, lease)
        if found is not None:
            found.at -= age
        if n == 1:  # after t0's call, before t1's reads: the coordinator takes t1 back
            r.hset(K.comp("book-5"), "t1", comp_encoder.encode(taken_back))
        return found

    monkeypatch.setattr(job_module._First, "member", stale)
    trips[0] = 0
    rq_job = run_one(worker, job)
    # 4, one per slip step that read for itself (t0, t1; each carrying the report before it), and
    # the take-back's own write (this process's too).
    assert trips[0] == 4 + 2 + 1
    assert reports(r, "book-5") == [("compensation-succeeded", "s"), ("compensation-succeeded", "t0")]
    assert "stopped at t1" in Job.fetch(rq_job.id, connection=r).return_value()
    assert not r.keys(K.lease("book-5", "*"))


def test_a_job_cut_short_after_its_start_is_in_the_started_registry_and_fails_there(
    r: redis.Redis, worker: SagaWorker
) -> None:
    """A worker killed mid-job: its start was written in one MULTI with the job's lease, and RQ's
    clean-up of the started registry moves the job to the failed registry (no retries left: one
    attempt), as for any RQ job."""
    job = plan(r, 3, attempts=1)
    found = worker.dequeue_job_and_maintain_ttl(None)
    assert found is not None
    rq_job, queue = found
    worker.prepare_execution(rq_job)  # and then nothing: the process died

    assert Job.fetch(rq_job.id, connection=r).get_status() == JobStatus.STARTED
    assert r.get(K.lease("book-3", "s"))  # taken in the same MULTI: the watchdog sees a live lease
    started = StartedJobRegistry(queue=queue)
    assert rq_job.id in started
    started.cleanup(timestamp=10**10)  # as RQ's maintenance does once the execution's heartbeat is old
    assert rq_job.id in FailedJobRegistry(queue=queue)
    assert reports(r, "book-3") == []
    assert job.job_id == rq_job.id


def test_rq_still_has_the_steps_and_names_the_trimmed_bookkeeping_overrides(r: redis.Redis) -> None:
    """workers/bookkeeping.py repeats RQ 3.0's per-job steps: a version that changes them fails here."""
    import inspect

    from rq import SimpleWorker
    from rq.executions import Execution
    from rq.results import Result

    for method, parameter in [
        (SimpleWorker.handle_job_success, "execution"),
        (SimpleWorker.cleanup_execution, "execution"),
        (SimpleWorker.prepare_job_execution, "remove_from_intermediate_queue"),
        (Execution.create, "worker_name"),
        (Result.create, "execution_started_at"),
    ]:
        assert parameter in inspect.signature(method).parameters, (method, parameter)
    job = Job.create("builtins.len", args=("x",), connection=r)
    for name in ("_dependency_ids", "_success_callback_name", "_failure_callback_name", "repeats_left"):
        assert hasattr(job, name), name
    assert "is_suspended(" in inspect.getsource(SimpleWorker.check_for_suspension)


def test_remembered_serializers_answer_as_rq_does_in_every_module_that_resolves_them() -> None:
    """workers/bookkeeping.py `remember_serializers`: RQ's own answers, once each; what it refuses still raises.

    Every RQ module that resolves a serializer is pointed at the remembering one: a module RQ adds or
    renames leaves the list out of date, and this fails."""
    import importlib
    import inspect
    import pkgutil

    import rq
    import rq.serializers
    from mcp_saga.workers.bookkeeping import RQ_SERIALIZER_USERS, remember_serializers
    from rq.serializers import DefaultSerializer, JSONSerializer

    remember_serializers()
    remember_serializers()  # idempotent: one layer
    resolve = rq.serializers.resolve_serializer
    assert getattr(resolve, "remembers", False)
    users = set()
    for info in pkgutil.walk_packages(rq.__path__, "rq."):
        try:
            source = inspect.getsource(importlib.import_module(info.name))
        except OSError:  # an empty module
            continue
        if "resolve_serializer(" in source and info.name != "rq.serializers":
            users.add(info.name)
    assert users - {"rq.cli.workers", "rq.cron"} == set(RQ_SERIALIZER_USERS)  # the CLI and cron: not a worker's path
    for name in RQ_SERIALIZER_USERS:
        assert importlib.import_module(name).resolve_serializer is resolve, name

    class Custom:
        @staticmethod
        def dumps(obj: object) -> bytes:
            return b""

        @staticmethod
        def loads(data: bytes) -> object:
            return None

    for given, expected in [(None, DefaultSerializer), ("json", JSONSerializer), ("pickle", DefaultSerializer)]:
        assert resolve(given) is expected and resolve(given) is expected
    assert resolve(Custom) is Custom and resolve(Custom) is Custom
    for bad in (object, "builtins.len"):
        for _ in range(2):
            with pytest.raises(NotImplementedError):
                resolve(bad)
