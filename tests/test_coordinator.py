"""The coordinator against a real redis-server: in-process batches, then real processes."""

from __future__ import annotations

import signal
import time

import msgspec
import pytest
import redis
from mcp_saga.coordinator import consumer
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.coordinator.queue import enqueue_all
from mcp_saga.schemas.config import Config, CoordinatorSettings, RedisSettings, parse_config, write_config
from mcp_saga.schemas.events import (
    CompensationSucceeded,
    StepCompleted,
    WorkflowCompleted,
    WorkflowFailed,
    decode_entry,
    entry_fields,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import comp_decoder, job_decoder, state_from_hash
from processes import saga_process, stop, wait_for
from rq import Queue

K = Keys()
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$response.body#/id"}},
}


def step(name: str, **extra) -> StepCompleted:
    return StepCompleted(
        step=name,
        server="svc",
        tool="do",
        result={"structuredContent": {"id": f"id-{name}"}},
        recovery=RECOVERY,
        **extra,
    )


def publish(r: redis.Redis, workflow: str, *payloads) -> None:
    for payload in payloads:
        r.xadd(K.events, entry_fields(workflow, payload))


def drain(coordinator: Coordinator, rounds: int = 20) -> None:
    for _ in range(rounds):
        if not coordinator.step().events:
            return


def queued_jobs(r: redis.Redis):
    queue = Queue(K.queue, connection=r)
    return [job_decoder.decode(job.args[0]) for job in queue.get_jobs()]


@pytest.fixture
def coord(r: redis.Redis) -> Coordinator:
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}})
    c = Coordinator(r, config, name="test")
    c.ensure_group()
    return c


def test_records_steps_and_dispatches_lifo(r: redis.Redis, coord: Coordinator) -> None:
    publish(r, "order-1", step("a"), step("b"), step("c"), WorkflowFailed(reason="boom"))
    drain(coord)
    state = state_from_hash(r.hgetall(K.state("order-1")))
    assert (state.status, state.steps) == ("compensating", 3)
    assert [msgspec.json.decode(s)["step"] for s in r.lrange(K.steps("order-1"), 0, -1)] == ["a", "b", "c"]
    (job,) = queued_jobs(r)
    assert (job.step, job.operation_id, job.arguments) == ("c", "undo", {"id": "id-c"})
    # One job: the rest of the LIFO plan rides behind "c" as its routing slip, in order.
    assert [(m.step, m.arguments) for m in job.then] == [("b", {"id": "id-b"}), ("a", {"id": "id-a"})]
    assert r.zscore(K.index("compensating"), "order-1") is not None
    assert r.xpending(K.events, K.group)["pending"] == 0  # everything acknowledged

    for name in ("c", "b", "a"):  # the slip's worker reports each step as it goes
        comp = comp_decoder.decode(r.hget(K.comp("order-1"), name))
        assert comp.status == "queued" and comp.via == ("" if name == "c" else job.job_id)
        publish(r, "order-1", CompensationSucceeded(step=name, dispatch=comp.dispatch))
        drain(coord)
    assert state_from_hash(r.hgetall(K.state("order-1"))).status == "compensated"
    assert [j.step for j in queued_jobs(r)] == ["c"]  # no job of their own for the slip's steps
    assert r.zscore(K.index("compensated"), "order-1") is not None
    assert r.zscore(K.index("compensating"), "order-1") is None
    outcomes = [f[b"type"] for _, f in r.xrange(K.outcomes)]
    assert outcomes.count(b"compensation-succeeded") == 3 and b"workflow-compensated" in outcomes
    timeline = [f[b"type"].decode() for _, f in r.xrange(K.log("order-1"))]
    assert timeline[0] == "workflow-failed"  # steps planned for compensation are on the stack, not the timeline
    assert 0 < r.ttl(K.state("order-1")) <= coord.settings.retention_compensated


def test_duplicate_deliveries_dispatch_once(r: redis.Redis, coord: Coordinator) -> None:
    publish(r, "dup", step("a"), step("a"), WorkflowFailed(), WorkflowFailed())
    drain(coord)
    publish(r, "dup", step("a"), WorkflowFailed())
    drain(coord)
    assert r.llen(K.steps("dup")) == 1
    assert len(queued_jobs(r)) == 1


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"type": "step-completed", "workflow": "w", "data": "{not json"}, "step-completed data"),
        ({"type": "bogus", "workflow": "w", "data": "{}"}, "unknown event type"),
        ({"type": "workflow-failed", "workflow": "has space", "data": "{}"}, "invalid workflow id"),
        ({"type": "workflow-failed", "workflow": "{w}", "data": "{}"}, "invalid workflow id"),
        ({"type": "workflow-failed", "data": "{}"}, "missing field 'workflow'"),
        ({"type": "step-completed", "workflow": "w", "data": '{"step":"a"}'}, "missing required field"),
        ({"type": "workflow-failed", "workflow": "w", "data": b"\xff\xfe"}, "step"),
        ({"type": "workflow-failed", "workflow": "w", "data": "x" * 300_000}, "malformed"),
        ({"type": "compensation-succeeded", "workflow": "ghost", "data": '{"step":"a"}'}, "unknown workflow"),
        ({"type": "workflow-failed", "workflow": "w", "v": "9", "data": "{}"}, "unsupported wire version"),
    ],
)
def test_malformed_entries_go_to_dead_letter_with_reason(
    r: redis.Redis, coord: Coordinator, fields: dict, reason: str
) -> None:
    entry_id = r.xadd(K.events, fields)
    publish(r, "good", step("a"), WorkflowFailed())
    drain(coord)
    ((_, dead),) = r.xrange(K.dead_letter)
    assert dead[b"dead.id"] == entry_id
    if reason != "step":
        assert reason in dead[b"dead.reason"].decode()
    for key, value in fields.items():
        assert dead[key.encode()] == (value if isinstance(value, bytes) else value.encode())
    assert r.xpending(K.events, K.group)["pending"] == 0
    assert state_from_hash(r.hgetall(K.state("good"))).status == "compensating"  # the valid one went on


def test_completed_workflow_expires_and_gc_cleans_the_index(r: redis.Redis) -> None:
    config = parse_config({"coordinator": {"block_ms": 10, "retention_completed": 1}})
    coord = Coordinator(r, config, name="gc")
    coord.ensure_group()
    publish(r, "short", step("a"), WorkflowCompleted())
    drain(coord)
    assert r.zscore(K.index("completed"), "short") is not None
    wait_for(lambda: not r.exists(K.state("short")), 5, "retention expiry")
    assert not r.keys("saga:{short}:*")
    assert coord.store.collect_garbage() == 1
    assert r.zscore(K.index("completed"), "short") is None
    assert coord.trim_events() >= 2 and r.xlen(K.events) == 0


def test_two_coordinator_processes_share_the_group(r: redis.Redis, redis_url: str, tmp_path) -> None:
    procs = [
        saga_process("coordinator", "--name", f"c{i}", redis_url=redis_url, log=tmp_path / f"c{i}.log")
        for i in range(2)
    ]
    try:
        # Both in the group before any event, so the test sees the work shared, not one taking it all.
        wait_for(lambda: r.exists(K.events) and _consumers(r) == {"c0", "c1"}, 30, "both coordinators to join")
        workflows = [f"wf-{i}" for i in range(60)]
        pipe = r.pipeline()
        for wf in workflows:
            for payload in (step("a"), step("b"), step("c"), WorkflowFailed(parallel=True)):
                pipe.xadd(K.events, entry_fields(wf, payload))
        pipe.execute()
        wait_for(lambda: r.zcard(K.index("compensating")) == 60, 60, "all workflows compensating")
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0 and not _lag(r), 30, "acks")
        jobs = queued_jobs(r)
        assert len(jobs) == 180
        assert len({(j.workflow, j.step) for j in jobs}) == 180
        assert _consumers(r) == {"c0", "c1"}
    finally:
        for p in procs:
            assert stop(p) == 0, (tmp_path / "c0.log").read_text()[-3000:]


def _consumers(r: redis.Redis) -> set[str]:
    try:
        return {c["name"].decode() for c in r.xinfo_consumers(K.events, K.group)}
    except redis.ResponseError:  # no group yet
        return set()


def _lag(r: redis.Redis) -> int:
    (group,) = r.xinfo_groups(K.events)
    return group.get("lag") or 0


@pytest.mark.parametrize("carried", [True, False], ids=["job-carried-by-the-commit", "queue-on-its-own-connection"])
def test_sigkill_between_commit_and_enqueue_loses_nothing_and_doubles_nothing(
    r: redis.Redis, redis_url: str, tmp_path, carried: bool
) -> None:
    """A coordinator dies right after its state commit, before the event is acked: with the job
    carried by the commit's round trip (one Redis), or, with the queue on a connection of its own
    (`queue_url`, as beside a cluster), before the job is queued at all."""
    settings = CoordinatorSettings(claim_idle_ms=300, block_ms=50)
    queue = RedisSettings() if carried else RedisSettings(queue_url=redis_url)
    config = write_config(Config(redis=queue, coordinator=settings), tmp_path / "saga.toml")
    publish(r, "crash", step("a"), step("b"), WorkflowFailed())
    doomed = saga_process(
        "coordinator", "--name", "doomed", redis_url=redis_url, config=config,
        env={"SAGA_TEST_CRASH_AFTER_COMMIT": "1"}, log=tmp_path / "doomed.log",
    )  # fmt: skip
    assert doomed.wait(30) != 0
    assert state_from_hash(r.hgetall(K.state("crash"))).status == "compensating"  # committed...
    # ...queued with it, or never enqueued; never acked either way
    assert [(j.step, j.dispatch) for j in queued_jobs(r)] == ([("b", 1)] if carried else [])
    assert r.xpending(K.events, K.group)["pending"] > 0

    survivor = saga_process(
        "coordinator", "--name", "survivor", redis_url=redis_url, config=config, log=tmp_path / "s.log"
    )
    try:
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 30, "the survivor to claim and ack")
        jobs = wait_for(lambda: queued_jobs(r), 10, "the job")
        assert [(j.step, j.dispatch) for j in jobs] == [("b", 1)]
        assert r.llen(K.steps("crash")) == 2
    finally:
        assert stop(survivor) == 0


def test_sigterm_finishes_the_batch_and_exits_zero(r: redis.Redis, redis_url: str, tmp_path) -> None:
    proc = saga_process("coordinator", redis_url=redis_url, log=tmp_path / "c.log")
    publish(r, "t", step("a"))
    wait_for(lambda: r.exists(K.state("t")), 30, "the step to be recorded")
    assert stop(proc, signal.SIGTERM) == 0


# Ingest overlapped with the commit (issue 15): the next read goes out ahead of a batch's commit.


def small_batches(r: redis.Redis, batch: int) -> Coordinator:
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 10_000, "batch": batch}})
    c = Coordinator(r, config, name="overlap")
    c.ensure_group()
    return c


def test_a_batch_read_ahead_is_acknowledged_only_after_its_commit(r: redis.Redis) -> None:
    coord = small_batches(r, 2)
    assert coord.store.overlaps
    publish(r, "order-1", step("a"), step("b"))
    publish(r, "order-2", step("x"), step("y"))
    first = coord.step()
    # order-1 is committed; order-2 was read ahead and planned, nothing of it is written
    assert first.events == 2 and r.hget(K.state("order-1"), "steps") == b"2"
    assert not r.exists(K.state("order-2"))
    # Nothing of order-2 is acknowledged; order-1's acknowledgement rides with the next write.
    assert r.xpending(K.events, K.group)["pending"] == 4
    assert coord.step().events == 2
    # Nothing more in hand: both acknowledgements went out at the end of the step.
    assert r.hget(K.state("order-2"), "steps") == b"2" and r.xpending(K.events, K.group)["pending"] == 0


def test_a_short_batch_goes_straight_to_its_commit_and_its_ack_rides_with_the_blocking_read(r: redis.Redis) -> None:
    """An idle stream's batch reads nothing ahead: no read sits between a failure and its load."""
    coord = small_batches(r, 10)
    publish(r, "order-1", step("a"), step("b"))
    coord.step()
    publish(r, "order-1", WorkflowFailed(reason="boom"))
    reads = []
    original = coord.store.record_ahead
    coord.store.record_ahead = lambda *a, **kw: reads.append(a[0]) or original(*a, **kw)  # type: ignore[method-assign]
    result = coord.step()
    assert result.events == 1 and result.jobs == 1 and reads == []
    # Committed and dispatched; its acknowledgement is owed to the next write, and goes with the read.
    assert r.hget(K.state("order-1"), "status") == b"compensating" and len(queued_jobs(r)) == 1
    assert r.xpending(K.events, K.group)["pending"] == 1
    assert coord.step().events == 0 and r.xpending(K.events, K.group)["pending"] == 0


def test_a_workflow_in_two_batches_in_flight_keeps_its_order_and_numbering(r: redis.Redis) -> None:
    """The second batch's steps of a workflow the first batch is committing are planned after it."""
    coord = small_batches(r, 3)
    publish(r, "order-1", step("a"), step("b"), step("c"), step("d"), step("e"))
    coord.step()
    assert coord._ready is not None and coord._ready.held == {"order-1"}  # d, e: planned once a-c are in
    drain(coord)
    assert r.hget(K.state("order-1"), "steps") == b"5" and r.xpending(K.events, K.group)["pending"] == 0
    publish(r, "order-1", WorkflowFailed(reason="boom"))
    drain(coord)
    assert [msgspec.json.decode(s)["step"] for s in r.lrange(K.steps("order-1"), 0, -1)] == list("abcde")
    comps = {s.decode(): comp_decoder.decode(v) for s, v in r.hgetall(K.comp("order-1")).items()}
    assert sorted((c.seq, c.step) for c in comps.values()) == list(enumerate("abcde"))
    assert r.hget(K.state("order-1"), "status") == b"compensating"
    (job,) = queued_jobs(r)
    assert [job.step, *(m.step for m in job.then)] == list("edcba")
    assert r.xpending(K.events, K.group)["pending"] == 0


def test_a_flushed_script_is_loaded_again_and_the_batch_recorded(r: redis.Redis) -> None:
    coord = small_batches(r, 2)
    publish(r, "order-1", step("a"), step("b"))
    publish(r, "order-2", step("x"))
    coord.step()  # order-1 done, order-2 read ahead
    r.script_flush()  # a restarted Redis has no scripts: the commit read ahead meets NOSCRIPT
    coord.step()
    assert r.hget(K.state("order-2"), "steps") == b"1"
    r.script_flush()  # and the straight path of a short batch, on an idle stream
    publish(r, "order-3", step("z"))
    assert coord.step().events == 1 and r.hget(K.state("order-3"), "steps") == b"1"
    coord.step()
    assert r.xpending(K.events, K.group)["pending"] == 0


def test_a_coordinator_stopping_finishes_the_batch_it_read_ahead(r: redis.Redis) -> None:
    coord = small_batches(r, 1)
    publish(r, "order-1", step("a"), step("b"))
    coord.step()
    assert r.xpending(K.events, K.group)["pending"] == 2  # "b" read ahead, and "a" acknowledged with the next write
    coord.stopping = True
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        coord.run()
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    assert r.hget(K.state("order-1"), "steps") == b"2" and r.xpending(K.events, K.group)["pending"] == 0


def test_a_running_workflow_keeps_its_idle_ttl_without_an_expire_per_step(r: redis.Redis) -> None:
    coord = small_batches(r, 10)
    idle = coord.settings.idle_ttl
    publish(r, "order-1", step("a"))
    drain(coord)
    keys = [K.state("order-1"), K.steps("order-1"), K.comp("order-1")]
    assert all(idle <= r.ttl(k) <= idle + idle // 1000 for k in keys)
    for k in keys:
        r.expire(k, idle + 5)  # as if renewed a while ago: more than the idle TTL left
    publish(r, "order-1", step("b"))
    drain(coord)
    assert r.hget(K.state("order-1"), "steps") == b"2"
    assert all(idle < r.ttl(k) <= idle + 5 for k in keys)  # left alone
    for k in keys:
        r.expire(k, idle - 5)  # less than the idle TTL left: renewed
    publish(r, "order-1", step("c"))
    drain(coord)
    assert all(idle <= r.ttl(k) <= idle + idle // 1000 for k in keys)


def test_a_redis_that_lost_its_scripts_still_gets_the_commit_and_its_job(
    r: redis.Redis, redis_url: str, tmp_path
) -> None:
    """Commits go by digest: after a SCRIPT FLUSH (a restarted or failed-over Redis) the refused
    commit is read again from the pending entries, committed once, and its compensation queued."""
    proc = saga_process("coordinator", redis_url=redis_url, log=tmp_path / "c.log")
    try:
        publish(r, "warm", step("a"), WorkflowCompleted())  # a commit: the coordinator loaded its scripts
        publish(r, "lost", step("a"), step("b"))
        wait_for(lambda: r.hget(K.state("warm"), "status") == b"completed", 30, "the first commit")
        wait_for(lambda: r.hget(K.state("lost"), "steps") == b"2", 30, "the steps to be recorded")
        r.script_flush()
        publish(r, "lost", WorkflowFailed(reason="boom"))
        wait_for(lambda: r.hget(K.state("lost"), "status") == b"compensating", 30, "the failure to be committed")
        wait_for(lambda: len(queued_jobs(r)) == 1, 30, "its compensation to be queued")
        (job,) = queued_jobs(r)
        assert [job.step, *(m.step for m in job.then)] == ["b", "a"]
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 30, "every entry to be acknowledged")
        assert proc.poll() is None, "the coordinator is still running"
        assert "lost its scripts" in (tmp_path / "c.log").read_text()
    finally:
        assert stop(proc, signal.SIGTERM) == 0


# A failure's jobs ride with its commit (issue 15: one round trip fewer from a failure to its worker).


def test_a_failures_job_is_queued_by_the_commits_round_trip_as_rq_would_queue_it(
    r: redis.Redis, coord: Coordinator
) -> None:
    publish(r, "ride-1", step("a"), step("b"))
    drain(coord)
    sent: list[list[object]] = []
    original = consumer.enqueue_all
    consumer.enqueue_all = lambda queue, jobs, settings: sent.append(jobs) or original(queue, jobs, settings)  # type: ignore[assignment]
    try:
        publish(r, "ride-1", WorkflowFailed(reason="boom"))
        drain(coord)
    finally:
        consumer.enqueue_all = original  # type: ignore[assignment]
    assert all(jobs == [] for jobs in sent)  # nothing left for a round trip of its own
    (job,) = queued_jobs(r)
    assert (job.step, [m.step for m in job.then]) == ("b", ["a"])

    # The hash is RQ's own enqueue's, field for field (the timestamps and the backoff's jitter aside),
    # and RQ lists the job.
    def fields() -> dict[bytes, bytes]:
        found = r.hgetall(f"rq:job:{job.job_id}")
        assert len(msgspec.json.decode(found.pop(b"retry_intervals"))) == coord.config.worker.attempts - 1
        return {k: v for k, v in found.items() if not k.endswith(b"_at")}

    carried = fields()
    r.delete(f"rq:job:{job.job_id}", f"rq:queue:{K.queue}")
    assert enqueue_all(Queue(K.queue, connection=r), [job], coord.config.worker) == [True]
    assert carried == fields()
    assert K.queue in [q.name for q in Queue.all(connection=r)]


def test_a_commit_another_coordinator_beat_carries_no_job(r: redis.Redis, coord: Coordinator) -> None:
    """The job rides behind the commit in the same pipeline, so a refused commit must not let it through."""
    publish(r, "ride-2", step("a"))
    drain(coord)
    views = coord.store.load({"ride-2": (True, ())})
    fields = entry_fields("ride-2", WorkflowFailed(reason="boom"))
    failed = decode_entry("1-1", {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()})
    coord.machine.apply(views["ride-2"], failed, time.time())
    assert views["ride-2"].jobs
    r.hincrby(K.state("ride-2"), "version", 1)  # another coordinator's commit in between
    carried: dict[str, bool] = {}
    assert coord.store.commit([views["ride-2"]], carried) == [False]
    assert carried == {} and queued_jobs(r) == [] and not r.keys("rq:job:*")


def test_the_queue_on_a_connection_of_its_own_takes_the_jobs_after_the_commit(r: redis.Redis) -> None:
    """With `queue_url` (beside a cluster, say) one pipeline reaches only one of the two: no carrying."""
    config = parse_config({"coordinator": {"block_ms": 10}})
    coord = Coordinator(r, config, name="apart", queue=redis.Redis(connection_pool=r.connection_pool))
    coord.ensure_group()
    assert not coord.store.carries
    publish(r, "ride-3", step("a"), WorkflowFailed(reason="boom"))
    drain(coord)
    assert [j.step for j in queued_jobs(r)] == ["a"]
