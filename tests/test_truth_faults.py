"""The coordinator tells the truth under faults (issue 11): real processes, a real redis-server.

Each test names the defect it guards against: a slow server kept its workflow `compensating`
forever; indexes and outcomes were lost by a crash between commit and follow-up; entries were
acknowledged under OOM though their dead letters had been refused; the process exited when its
consumer group vanished; a failure with an over-long reason was dead-lettered whole.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.coordinator.store import Store
from mcp_saga.runtime import failpoints
from mcp_saga.runtime.failpoints import FailPointError
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import Config, dump_config, parse_config
from mcp_saga.schemas.events import CompensationSucceeded, StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import comp_decoder, state_from_hash
from processes import REPO, free_port, saga_process, stop, wait_for, wait_until_accepting

K = Keys()

# A server whose compensating tool never answers in time; every call is counted in a file.
SLOW = """
import asyncio, sys
from mcp.server.mcpserver import MCPServer
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool

app = MCPServer("slow", log_level="WARNING")
CALLS = sys.argv[2]

@recoverable_tool(app, compensation("undo", id="$response.body#/id"))
def do() -> dict:
    return {"id": "x"}

@app.tool()
async def undo(id: str, idempotencyKey: str | None = None) -> str:
    with open(CALLS, "a") as calls:
        calls.write(id + "\\n")
    await asyncio.sleep(3600)
    return "never"

app.run("streamable-http", port=int(sys.argv[1]))
"""
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$response.body#/id"}},
}


def toml(data: dict[str, Any]) -> str:
    """The TOML a process reads, built from the config model (so it passes the start-up checks)."""
    return dump_config(parse_config(data))


def step(name: str, server: str = "svc", recovery: dict | None = RECOVERY) -> StepCompleted:
    return StepCompleted(
        step=name, server=server, tool="do", result={"structuredContent": {"id": f"id-{name}"}}, recovery=recovery
    )


def publish(r: redis.Redis, workflow: str, *payloads: Any) -> None:
    for payload in payloads:
        r.xadd(K.events, entry_fields(workflow, payload))


def status(r: redis.Redis, workflow: str) -> str | None:
    raw = r.hget(K.state(workflow), "status")
    return raw.decode() if raw else None


def indexed(r: redis.Redis, workflow: str) -> list[str]:
    return [s for s in STATUSES if r.zscore(K.index(s), workflow) is not None]


@pytest.fixture
def private_redis() -> Iterator[redis.Redis]:
    """A redis-server of the test's own: these tests flush it and fill its memory."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary).start()
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()
        server.cleanup()


def url_of(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


# 1. The watchdog acts only on a compensation that has gone silent ------------------------------


def test_a_slow_server_ends_needs_attention_with_at_most_attempts_calls(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Attempts that time out keep reporting: the watchdog waits, the budget holds, the end is told.

    Five attempts of one second each plus backoff outlast `watchdog_after` (three seconds); before
    the fix the watchdog re-dispatched from the dispatch time on, each re-dispatch with a fresh
    budget, and the workflow stayed `compensating` while the server got call after call.
    """
    calls = tmp_path / "calls"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SLOW, str(port), str(calls)], cwd=REPO, stderr=subprocess.DEVNULL)
    config = tmp_path / "saga.toml"
    attempts = 5
    config.write_text(
        toml(
            {
                "servers": {"slow": {"url": f"http://127.0.0.1:{port}/mcp", "timeout": 1}},
                "coordinator": {"block_ms": 50, "watchdog_after": 3, "watchdog_every": 0.2, "claim_idle_ms": 1000},
                "worker": {"attempts": attempts, "backoff_base": 0.1, "backoff_max": 1, "jitter": 0, "lease": 6},
            }
        )
    )
    procs = []
    try:
        wait_until_accepting("127.0.0.1", port, server)
        procs.append(saga_process("coordinator", redis_url=redis_url, config=config, log=tmp_path / "c.log"))
        procs.append(saga_process("worker", redis_url=redis_url, config=config, log=tmp_path / "w.log"))
        publish(r, "slow-1", step("a", server="slow"), WorkflowFailed(reason="boom"))
        wait_for(lambda: status(r, "slow-1") == "needs-attention", 90, "the workflow to end needs-attention")
    finally:
        stop(server)
        for proc in procs:
            stop(proc)
    state = state_from_hash(r.hgetall(K.state("slow-1")))
    assert state.attention.startswith("step a: failed ("), state.attention
    comp = comp_decoder.decode(r.hget(K.comp("slow-1"), "a"))
    made = calls.read_text().splitlines()
    assert len(made) <= attempts * comp.dispatch, (made, comp.dispatch)
    assert comp.spent == attempts and comp.status == "failed"
    assert indexed(r, "slow-1") == ["needs-attention"]


# 2. What a transition implies survives a crash between its commit and its follow-up ------------


def test_sigkill_between_commit_and_follow_up_keeps_index_and_outcome(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A crash right after the commit loses neither the index entry nor the outcome, and doubles neither.

    On one Redis the commit's own script writes them (Store.indexes_in_commit), so they are there
    the moment the commit is; the heir, which folds the claimed entries to no change, must neither
    drop nor repeat them. (On a cluster they follow from the outbox: before that fix the follow-up
    ran only for a batch that changed something, and a redelivered batch folds to no change, so
    the workflow stayed out of every index for good; tests/test_cluster.py covers that path.)
    """
    bad = {"strategy": "compensation"}  # no compensating operation: the step is unrecoverable
    publish(r, "crash-1", step("a", recovery=bad), WorkflowFailed(reason="boom"))
    config = tmp_path / "saga.toml"
    config.write_text(toml({"coordinator": {"block_ms": 50, "claim_idle_ms": 300}}))
    crashing = saga_process(
        "coordinator",
        "--name",
        "doomed",
        redis_url=redis_url,
        config=config,
        env={"SAGA_TEST_CRASH_AFTER_COMMIT": "1"},
        log=tmp_path / "doomed.log",
    )
    assert crashing.wait(30) == 70
    assert status(r, "crash-1") == "needs-attention"  # committed, and with it ...
    assert indexed(r, "crash-1") == ["needs-attention"] and r.xlen(K.outcomes) == 1  # ... its index and outcome
    healthy = saga_process("coordinator", "--name", "heir", redis_url=redis_url, config=config, log=tmp_path / "h.log")
    try:
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 30, "the heir to claim and acknowledge")
    finally:
        stop(healthy)
    assert indexed(r, "crash-1") == ["needs-attention"]
    outcomes = [f for _, f in r.xrange(K.outcomes)]
    assert [f[b"type"] for f in outcomes] == [b"workflow-needs-attention"]
    assert not r.exists(K.outbox("crash-1"))
    assert [wf for wf, _ in Reader(r, K).recent("needs-attention")] == ["crash-1"]


def test_without_the_index_in_the_commit_a_crash_before_the_follow_up_is_repaired_from_the_outbox(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's path, where the indexes and outcomes live in other slots than the workflow:
    the commit leaves its outcomes in the workflow's outbox, and a coordinator that dies before
    its follow-up leaves index and outcomes to whoever folds the entries again (here on one Redis,
    with the commit told not to write them itself)."""
    monkeypatch.setattr(Store, "indexes_in_commit", property(lambda _: False))
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}})
    doomed = Coordinator(r, config, name="doomed")
    doomed.ensure_group()
    bad = {"strategy": "compensation"}
    publish(r, "outboxed", step("a", recovery=bad), WorkflowFailed(reason="boom"))
    failpoints.arm("coordinator.after-commit=raise")
    try:
        with pytest.raises(FailPointError):
            doomed.process(doomed._read(">"), redelivered=False)
    finally:
        failpoints.arm("coordinator.after-commit=off")
    assert status(r, "outboxed") == "needs-attention"
    assert indexed(r, "outboxed") == [] and r.xlen(K.outcomes) == 0 and r.llen(K.outbox("outboxed")) == 1
    heir = Coordinator(r, config, name="heir")
    time.sleep(0.15)  # past claim_idle_ms
    heir.step()
    assert indexed(r, "outboxed") == ["needs-attention"]
    assert [f[b"type"] for _, f in r.xrange(K.outcomes)] == [b"workflow-needs-attention"]
    assert not r.exists(K.outbox("outboxed"))
    assert r.xpending(K.events, K.group)["pending"] == 0


def test_a_late_follow_up_never_moves_a_workflow_back(r: redis.Redis) -> None:
    """Two coordinators' follow-ups may land in either order; the index keeps the newer state."""
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}})
    coord = Coordinator(r, config, name="c")
    coord.ensure_group()
    publish(r, "race", step("a"), WorkflowFailed())
    coord.process(coord._read(">"), redelivered=False)
    assert indexed(r, "race") == ["compensating"]
    # A follow-up of an older transition (version 1, running) arrives late.
    created = f"{state_from_hash(r.hgetall(K.state('race'))).created_at:.6f}"
    coord.store.follow_up([("race", created, 1, "running", "1.0", "-")], [], [])
    assert indexed(r, "race") == ["compensating"]
    assert r.zscore(K.deadlines, "race") is not None


def test_a_report_claimed_after_its_workflow_expired_takes_it_out_of_every_index(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A coordinator commits a workflow's last transition and dies before its follow-up; the
    workflow's retention runs out before the report is claimed again. The heir finds no state and
    dead-letters the report, and must take the workflow out of the indexes too.

    Before the fix the index kept `compensating` (what the follow-up before the lost one wrote),
    which the sweep looks at only after the idle TTL: the reduced chaos run met it once
    (`saga:index:{idx}:compensating chaos-0-00026 (gone)`), and `saga list` showed it for a week.
    """
    config = tmp_path / "saga.toml"
    config.write_text(toml({"coordinator": {"block_ms": 50, "claim_idle_ms": 300, "retention_compensated": 1}}))
    first = saga_process("coordinator", "--name", "first", redis_url=redis_url, config=config, log=tmp_path / "1.log")
    try:
        publish(r, "late-1", step("a"), WorkflowFailed(reason="boom"))
        wait_for(lambda: indexed(r, "late-1") == ["compensating"], 30, "the unwind to start")
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 30, "the first coordinator to ack")
    finally:
        stop(first)
    assert r.zscore(K.deadlines, "late-1") is not None  # the watchdog's deadline of the dispatch
    publish(r, "late-1", CompensationSucceeded(step="a", dispatch=1))  # what the worker would report
    crashing = saga_process(
        "coordinator", "--name", "doomed", redis_url=redis_url, config=config,
        env={"SAGA_TEST_CRASH_AFTER_COMMIT": "1"}, log=tmp_path / "doomed.log",
    )  # fmt: skip
    assert crashing.wait(30) == 70
    wait_for(lambda: not r.exists(K.state("late-1")), 30, "the compensated workflow's retention to run out")
    # On one Redis the commit wrote `compensated` into the index itself (on a cluster the follow-up
    # of it was lost with the coordinator, and the index kept `compensating`): either way it names
    # a workflow that is gone.
    assert indexed(r, "late-1") == ["compensated"]
    heir = saga_process("coordinator", "--name", "heir", redis_url=redis_url, config=config, log=tmp_path / "h.log")
    try:
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 30, "the heir to claim and acknowledge")
    finally:
        stop(heir)
    assert [f[b"type"] for _, f in r.xrange(K.dead_letter)] == [b"compensation-succeeded"]
    assert indexed(r, "late-1") == []
    assert r.zscore(K.deadlines, "late-1") is None and not r.hexists(K.index_versions, "late-1")


def test_a_follow_up_written_after_its_workflow_expired_does_not_bring_it_back(r: redis.Redis) -> None:
    """A coordinator paused (SIGSTOP) between its read and its index write, for longer than the
    workflow took to settle, expire and be swept, writes an index item of a workflow that is gone.

    The sweep had forgotten the workflow's version, so nothing said the item was old: before the
    fix it put the workflow back in `compensating`, where the sweep looks only after the idle TTL.
    """
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}})
    coord = Coordinator(r, config, name="c")
    coord.ensure_group()
    publish(r, "paused", step("a"), WorkflowFailed())
    coord.process(coord._read(">"), redelivered=False)
    assert indexed(r, "paused") == ["compensating"]
    state = state_from_hash(r.hgetall(K.state("paused")))
    # What the paused coordinator read: compensating, with its watchdog deadline.
    late = ("paused", f"{state.created_at:.6f}", state.version, "compensating", f"{state.updated_at:.6f}", "1.0")
    r.delete(*K.workflow_keys("paused"))  # settled and expired meanwhile (retention)
    assert coord.store.collect_garbage(time.time() + config.coordinator.idle_ttl + 1) >= 1
    assert indexed(r, "paused") == []
    coord.store.follow_up([late], [], [])
    assert indexed(r, "paused") == [] and r.zscore(K.deadlines, "paused") is None


# 5. Redis conditions that heal never end the process, and never ack what was refused -----------


def test_under_oom_nothing_is_acknowledged_until_dead_letters_are_written(
    private_redis: redis.Redis, tmp_path: Path
) -> None:
    """Before the fix 100 of 200 malformed entries were acknowledged with their dead letters refused."""
    r = private_redis
    for n in range(200):
        r.xadd(K.events, {"type": "bogus", "workflow": f"w{n}", "data": "{}"})
    r.xgroup_create(K.events, K.group, id="0")
    used = r.info("memory")["used_memory"]
    r.config_set("maxmemory", used + 64 * 1024)
    # Fill what is left, so every write the coordinator tries is refused.
    n = 0
    while True:
        try:
            r.set(f"filler:{n}", "x" * 4096)
            n += 1
        except redis.ResponseError:
            break
    proc = saga_process("coordinator", redis_url=url_of(r), log=tmp_path / "c.log")
    try:
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] > 0, 30, "the coordinator to read the entries")
        wait_for(lambda: "redis refused a write" in (tmp_path / "c.log").read_text(), 30, "the refusal to be logged")
        assert proc.poll() is None
        assert r.xlen(K.dead_letter) == 0
        assert r.xpending(K.events, K.group)["pending"] > 0  # read, refused, and kept pending: not acknowledged
        r.config_set("maxmemory", 0)
        wait_for(lambda: r.xlen(K.dead_letter) == 200, 60, "every entry to be dead-lettered")
        wait_for(lambda: r.xpending(K.events, K.group)["pending"] == 0, 10, "every entry to be acknowledged")
        assert r.xlen(K.dead_letter) == 200  # each once: refused writes were not half-kept
        assert proc.poll() is None
    finally:
        r.config_set("maxmemory", 0)
        assert stop(proc) == 0


def test_flushall_under_a_running_coordinator_recreates_the_group_and_says_so(
    private_redis: redis.Redis, tmp_path: Path
) -> None:
    r = private_redis
    config = tmp_path / "saga.toml"
    config.write_text(toml({"coordinator": {"block_ms": 50, "claim_idle_ms": 500}}))
    log = tmp_path / "c.log"
    proc = saga_process("coordinator", redis_url=url_of(r), config=config, log=log)
    try:
        publish(r, "before", step("a", recovery=None), WorkflowFailed())
        wait_for(lambda: status(r, "before") == "compensated", 30, "the first workflow")
        r.flushall()
        wait_for(lambda: "consumer group vanished" in log.read_text(), 30, "the loss to be reported")
        publish(r, "after", step("a", recovery=None), WorkflowFailed())
        wait_for(lambda: status(r, "after") == "compensated", 30, "a workflow published after the flush")
        assert proc.poll() is None
        assert indexed(r, "after") == ["compensated"]
    finally:
        assert stop(proc, signal.SIGTERM) == 0


# 6. A failure signal is never lost ----------------------------------------------------------


def test_an_over_long_mistyped_failure_still_unwinds(r: redis.Redis) -> None:
    coord = Coordinator(r, parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}}), name="c")
    coord.ensure_group()
    publish(r, "trace", step("a"))
    data = {"reason": "Traceback (most recent call last):\n" + "  frame\n" * 3000, "failedStep": "charge"}
    r.xadd(K.events, {"type": "workflow-failed", "workflow": "trace", "data": msgspec.json.encode(data)})
    coord.process(coord._read(">"), redelivered=False)
    assert r.xlen(K.dead_letter) == 0
    assert status(r, "trace") == "compensating"
    state = state_from_hash(r.hgetall(K.state("trace")))
    assert state.reason.endswith("more characters cut]") and len(state.reason) <= 8192
    timeline = Reader(r, K).snapshot("trace").timeline  # type: ignore[union-attr]
    (note,) = [e for e in timeline if e.type == "event-repaired"]
    assert note.detail and "reason:" in note.detail and "failedStep: str" in note.detail


def test_a_step_over_the_size_cap_is_recorded_not_dead_lettered(r: redis.Redis) -> None:
    """Its result is left out (noted), so a binding on it is unrecoverable: flagged, never guessed."""
    coord = Coordinator(r, parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100}}), name="c")
    coord.ensure_group()
    huge = step("a").result | {"content": [{"type": "text", "text": "x" * 400_000}]}
    publish(r, "big", msgspec.structs.replace(step("a"), result=huge), WorkflowFailed())
    coord.process(coord._read(">"), redelivered=False)
    coord.process(coord._read(">"), redelivered=False)
    assert r.xlen(K.dead_letter) == 0
    comp = comp_decoder.decode(r.hget(K.comp("big"), "a"))
    assert comp.status == "unrecoverable" and "recovery unavailable" in (comp.reason or "")
    assert status(r, "big") == "needs-attention"


# 3. Start-up checks ---------------------------------------------------------------------------


def test_settings_that_defeat_a_guarantee_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"coordinator.barrier_grace .* claim_idle_ms"):
        parse_config({"coordinator": {"barrier_grace": 30, "claim_idle_ms": 30_000}})
    # A retry's backoff is not silence (the watchdog counts from its end), so a short watchdog
    # beside a long backoff keeps every guarantee; a lease too short to survive a stall is pointed out.
    assert parse_config({"coordinator": {"watchdog_after": 5}, "worker": {"backoff_max": 60}}).warnings() == []
    assert "worker.lease" in parse_config({"worker": {"lease": 1}}).warnings()[0]
    with pytest.raises(ValueError, match=r"worker\.job_timeout"):
        parse_config({"servers": {"s": {"url": "http://h/mcp", "timeout": 400}}})
    assert Config().warnings() == []
    assert "barrier_grace = 0" in parse_config({"coordinator": {"barrier_grace": 0}}).warnings()[0]
    # A gateway that completes quiet sessions must do it before the coordinator fails one with an open call.
    assert "gateway.idle_timeout" in parse_config({"gateway": {"on_idle": "complete"}}).warnings()[0]
    assert parse_config({"gateway": {"on_idle": "complete", "idle_timeout": 600}}).warnings() == []


def test_barrier_waits_while_a_step_of_the_workflow_is_pending_in_the_group(r: redis.Redis) -> None:
    """A coordinator that stalls holding the last step: the barrier outlasts its grace until the claim."""
    config = parse_config({"coordinator": {"block_ms": 10, "claim_idle_ms": 100, "barrier_grace": 0.2}})
    survivor, stalled = Coordinator(r, config, name="survivor"), Coordinator(r, config, name="stalled")
    survivor.ensure_group()
    publish(r, "held", step("a"))
    survivor.process(survivor._read(">"), redelivered=False)
    publish(r, "held", step("b"))
    assert len(stalled._read(">")) == 1  # read and never acknowledged: the stall
    publish(r, "held", WorkflowFailed(steps_completed=2))
    survivor.process(survivor._read(">"), redelivered=False)
    assert status(r, "held") == "failed"
    wait_for(lambda: r.zscore(K.deadlines, "held") is not None, 5, "a barrier deadline")
    time.sleep(0.3)  # past the grace: without the pending check the barrier would expire here
    survivor.watch()
    assert status(r, "held") == "failed"
    claimed = wait_for(survivor._claim, 5, "the stalled step to be claimable")
    survivor.process(claimed, redelivered=True)
    assert status(r, "held") == "compensating"
    records = Reader(r, K).records("held")[1].values()  # type: ignore[index]
    (job,) = [c for c in records if c.status == "queued" and not c.via]
    assert job.step == "b"  # LIFO kept: the held step first ("a" rides behind it in its routing slip)
