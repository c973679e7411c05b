"""Compensations end to end: real redis-server, real worker processes, real MCP servers.

Each test plays the coordinator's part by hand (writes the compensation record, enqueues the job
with `mcp_saga.coordinator.queue.enqueue`), runs `python -m mcp_saga.workers`, and then reads the reports on
`saga:events` and the example servers' SQLite ledgers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from mcp import Client
from mcp_saga.coordinator.queue import enqueue
from mcp_saga.examples.ledger import read_state
from mcp_saga.runtime.failpoints import FAILPOINTS_ENV
from mcp_saga.schemas import config as model
from mcp_saga.schemas.config import WorkerSettings
from mcp_saga.schemas.events import decode_entry
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import Compensation, CompensationJob, arguments_digest, comp_encoder, idempotency_key
from processes import REPO, free_port, start_http_server, stdio_params, stop, wait_for, wait_until_accepting
from rq import Queue, Worker
from rq.job import Job
from test_worker_sessions import SCRATCH

K = Keys()
FAST = {"attempts": 5, "backoff_base": 0, "jitter": 0}


# The coordinator's part.


def plan(
    r: redis.Redis,
    workflow: str,
    step: str,
    arguments: dict[str, Any],
    *,
    server: str = "payments",
    tool: str = "charge_payment",
    operation: str = "refund_payment",
    dispatch: int = 1,
    approved: bool = False,
    worker: dict[str, Any] | None = None,
) -> CompensationJob:
    key = idempotency_key(workflow, step, operation)
    record = Compensation(
        step=step,
        seq=1,
        server=server,
        tool=tool,
        status="queued",
        operation_id=operation,
        arguments=arguments,
        idempotency_key=key,
        source="server",
        dispatch=dispatch,
        approved=approved,
    )
    r.hset(K.comp(workflow), step, comp_encoder.encode(record))
    job = CompensationJob(
        workflow=workflow,
        step=step,
        server=server,
        tool=tool,
        operation_id=operation,
        arguments=arguments,
        idempotency_key=key,
        dispatch=dispatch,
        approved=approved,
    )
    assert enqueue(Queue(K.queue, connection=r), job, WorkerSettings(**(worker or FAST)))
    return job


def reports(r: redis.Redis, workflow: str) -> list[tuple[str, Any]]:
    """(type, payload struct) of each report, decoded as the coordinator decodes them."""
    events = (decode_entry(entry_id.decode(), fields) for entry_id, fields in r.xrange(K.events))
    return [(event.type, event.data) for event in events if event.workflow == workflow]


# Worker processes, configs and servers.


def write_config(path: Path, servers: dict[str, dict[str, Any]], **sections: dict[str, Any]) -> Path:
    """Validated by the config model before it is written, like every config the tests hand a process."""
    return model.write_config(model.parse_config({"servers": servers, "worker": FAST, **sections}), path)


def worker_command(redis_url: str, config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mcp_saga.workers", "--redis", redis_url, "--config", str(config), *extra]


def run_burst(redis_url: str, config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        worker_command(redis_url, config, "--burst"),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def start_worker(
    redis_url: str, config: Path, name: str, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            worker_command(redis_url, config, "--name", name),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


def payments_stdio(db: Path, *args: str) -> dict[str, Any]:
    return {"command": [sys.executable, "-m", "mcp_saga.examples.payments", "--db", str(db), *args], "cwd": str(REPO)}


def charge(target: Any, order: str = "order-42", amount: float = 10) -> str:
    async def go() -> str:
        async with Client(target) as client:
            result = await client.call_tool("charge_payment", {"orderId": order, "amount": amount})
            assert not result.is_error, result.content
            return result.structured_content["transactionId"]

    return asyncio.run(go())


def refunds(db: Path) -> list[dict[str, Any]]:
    return [e for e in read_state(db)["effects"] if e["tool"] == "refund_payment"]


def calls(db: Path, tool: str) -> int:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT n FROM calls WHERE tool = ?", (tool,)).fetchone()
    return row[0] if row else 0


def rq_result(r: redis.Redis, job: CompensationJob) -> Any:
    return Job.fetch(job.job_id, connection=r).return_value()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "payments.db"


@pytest.fixture
def payments_http(db: Path) -> Iterator[str]:
    with start_http_server("mcp_saga.examples.payments", "--db", str(db)) as (_, url):
        yield url


# The tests.


def test_success_over_stdio(r: redis.Redis, redis_url: str, tmp_path: Path, db: Path) -> None:
    transaction = charge(stdio_params("mcp_saga.examples.payments", "--db", str(db)))
    config = write_config(tmp_path / "saga.toml", {"payments": payments_stdio(db)})
    job = plan(r, "order-1", "charge", {"transactionId": transaction})

    done = run_burst(redis_url, config)

    assert done.returncode == 0, done.stderr
    [(kind, report)] = reports(r, "order-1")
    assert kind == "compensation-succeeded"
    assert report.attempt == 1 and report.final and report.dispatch == 1
    assert report.server == "payments" and report.operation_id == "refund_payment"
    assert report.idempotency_key == job.idempotency_key
    assert report.arguments_digest == arguments_digest({"transactionId": transaction})
    assert report.duration_ms > 0 and report.worker
    assert report.result["structuredContent"]["status"] == "refunded"
    [refund] = refunds(db)
    assert refund["holding"] == transaction and refund["idempotencyKey"] == job.idempotency_key
    assert not r.exists(K.lease("order-1", "charge"))
    assert rq_result(r, job) == "succeeded"
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert any(
        e["msg"] == "compensation succeeded" and e["workflow"] == "order-1" and e["step"] == "charge" for e in logged
    )  # structured logs name the workflow and the step


def test_fails_twice_with_is_error_then_succeeds_once(r: redis.Redis, redis_url: str, tmp_path: Path, db: Path) -> None:
    with start_http_server("mcp_saga.examples.payments", "--db", str(db), "--fail-first", "2") as (_, url):
        transaction = charge(url)
        config = write_config(tmp_path / "saga.toml", {"payments": {"url": url}})
        job = plan(r, "order-2", "charge", {"transactionId": transaction})

        assert run_burst(redis_url, config).returncode == 0

    got = reports(r, "order-2")
    assert [kind for kind, _ in got] == ["compensation-failed", "compensation-failed", "compensation-succeeded"]
    assert [(d.attempt, d.final) for _, d in got] == [(1, False), (2, False), (3, True)]
    assert all(d.retryable and "transient failure injected" in d.error for _, d in got[:2])
    assert {d.idempotency_key for _, d in got} == {job.idempotency_key}
    assert calls(db, "refund_payment") == 3
    assert len(refunds(db)) == 1


def test_a_permanent_failure_ends_with_a_final_report(r: redis.Redis, redis_url: str, tmp_path: Path, db: Path) -> None:
    with start_http_server("mcp_saga.examples.payments", "--db", str(db)) as (_, url):
        config = write_config(tmp_path / "saga.toml", {"payments": {"url": url}}, worker={**FAST, "attempts": 3})
        job = plan(r, "order-3", "charge", {"transactionId": "TXN-NEVER-CHARGED"}, worker={**FAST, "attempts": 3})
        assert run_burst(redis_url, config).returncode == 0

    got = reports(r, "order-3")
    assert [(kind, d.attempt, d.final) for kind, d in got] == [
        ("compensation-failed", 1, False),
        ("compensation-failed", 2, False),
        ("compensation-failed", 3, True),
    ]
    assert all(d.retryable and "unknown charge" in d.error for _, d in got)
    assert rq_result(r, job).startswith("failed")  # reported as final, so RQ does not retry it again
    assert refunds(db) == []


def test_unknown_tools_and_invalid_arguments_are_not_retried(
    r: redis.Redis, redis_url: str, tmp_path: Path, db: Path, payments_http: str
) -> None:
    config = write_config(tmp_path / "saga.toml", {"payments": {"url": payments_http}})
    plan(r, "order-4", "unknown", {"transactionId": "TXN-1"}, operation="refund_everything")
    plan(r, "order-4", "invalid", {"transactionId": {"not": "a string"}})
    plan(r, "order-4", "missing", {})

    assert run_burst(redis_url, config).returncode == 0

    by_step = {d.step: (kind, d) for kind, d in reports(r, "order-4")}
    assert len(reports(r, "order-4")) == 3  # one attempt each, although five were allowed
    kind, unknown = by_step["unknown"]
    assert kind == "compensation-refused" and unknown.status == "unrecoverable"
    assert "does not list 'refund_everything'" in unknown.reason
    kind, invalid = by_step["invalid"]
    assert kind == "compensation-failed" and invalid.final and not invalid.retryable
    assert "validation error" in invalid.error
    kind, missing = by_step["missing"]
    assert kind == "compensation-failed" and missing.final and not missing.retryable
    assert "missing required arguments: transactionId" in missing.error


def test_server_down_then_up(r: redis.Redis, redis_url: str, tmp_path: Path, db: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "mcp_saga.examples.payments", "--http", str(port), "--db", str(db)]
    server = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
    wait_until_accepting("127.0.0.1", port, server)
    transaction = charge(f"http://127.0.0.1:{port}/mcp")
    stop(server)
    settings = {"attempts": 8, "backoff_base": 1, "backoff_max": 2, "jitter": 0}
    url = f"http://127.0.0.1:{port}/mcp"
    config = write_config(tmp_path / "saga.toml", {"payments": {"url": url}}, worker=settings)
    worker = start_worker(redis_url, config, "w-down-up", tmp_path / "worker.log")
    try:
        plan(r, "order-5", "charge", {"transactionId": transaction}, worker=settings)
        wait_for(lambda: reports(r, "order-5"), what="the first report")
        [(kind, first)] = reports(r, "order-5")[:1]
        assert kind == "compensation-failed" and first.retryable and not first.final
        assert "ConnectError" in first.error

        info = subprocess.run(
            [sys.executable, "-m", "rq.cli", "info", "--url", redis_url], capture_output=True, text=True, timeout=30
        )
        assert "saga" in info.stdout and "w-down-up" in info.stdout, info.stdout + info.stderr

        server = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
        wait_until_accepting("127.0.0.1", port, server)
        wait_for(lambda: reports(r, "order-5")[-1][0] == "compensation-succeeded", what="success after restart")
        kind, last = reports(r, "order-5")[-1]
        assert last.attempt >= 2 and last.final
        assert len(refunds(db)) == 1
    finally:
        stop(server)
        code = stop(worker)
    assert code == 0  # SIGTERM: warm shutdown, exit 0
    assert Worker.all(connection=r) == []  # deregistered on the way out


def test_policy_approval_then_approved_and_deny(r: redis.Redis, redis_url: str, tmp_path: Path, db: Path) -> None:
    transaction = charge(stdio_params("mcp_saga.examples.payments", "--db", str(db)))
    servers = {"payments": payments_stdio(db)}
    approval = write_config(tmp_path / "approval.toml", servers, policy={"approval": ["payments:refund_*"]})
    deny = write_config(tmp_path / "deny.toml", servers, policy={"auto": ["*"], "deny": ["payments:*"]})

    plan(r, "order-6", "charge", {"transactionId": transaction})
    assert run_burst(redis_url, approval).returncode == 0
    [(kind, waiting)] = reports(r, "order-6")
    assert kind == "compensation-refused" and waiting.status == "awaiting-approval" and waiting.final
    assert refunds(db) == []

    plan(r, "order-6", "charge", {"transactionId": transaction}, dispatch=2, approved=True)  # `saga approve`
    assert run_burst(redis_url, approval).returncode == 0
    assert reports(r, "order-6")[-1][0] == "compensation-succeeded"
    assert len(refunds(db)) == 1

    plan(r, "order-7", "charge", {"transactionId": transaction})
    assert run_burst(redis_url, deny).returncode == 0
    [(kind, denied)] = reports(r, "order-7")
    assert kind == "compensation-refused" and denied.status == "unrecoverable"
    assert denied.reason == "policy denies payments:refund_payment"


def test_a_worker_killed_between_call_and_report_causes_one_effect(
    r: redis.Redis, redis_url: str, tmp_path: Path, db: Path, payments_http: str
) -> None:
    transaction = charge(payments_http)
    config = write_config(tmp_path / "saga.toml", {"payments": {"url": payments_http}}, worker={**FAST, "lease": 1})
    job = plan(r, "order-8", "charge", {"transactionId": transaction})

    crashed = run_burst(redis_url, config, env={FAILPOINTS_ENV: "worker.after-call=kill"})

    assert crashed.returncode == -signal.SIGKILL
    assert reports(r, "order-8") == []  # the call happened, its report never did
    [effect] = refunds(db)
    assert effect["idempotencyKey"] == job.idempotency_key
    # The coordinator's watchdog re-dispatches once the dead worker's lease has run out.
    wait_for(lambda: not r.exists(K.lease("order-8", "charge")), what="the dead worker's lease to expire")
    plan(r, "order-8", "charge", {"transactionId": transaction}, dispatch=2)
    assert run_burst(redis_url, config).returncode == 0

    [(kind, report)] = reports(r, "order-8")
    assert kind == "compensation-succeeded" and report.idempotency_key == job.idempotency_key
    assert report.result["structuredContent"]["transactionId"] == transaction
    assert refunds(db) == [effect]  # the server saw the key again and applied nothing new


def settle(r: redis.Redis, workflow: str, step: str) -> None:
    record = msgspec.json.decode(r.hget(K.comp(workflow), step))
    r.hset(K.comp(workflow), step, msgspec.json.encode({**record, "status": "succeeded"}))


def test_two_workers_never_run_one_compensation_at_once(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    servers = {"scratch": {"command": [sys.executable, "-c", SCRATCH], "cwd": str(REPO)}}
    settings = {**FAST, "attempts": 2}
    config = write_config(tmp_path / "saga.toml", servers, worker=settings)
    # Three dispatches of one compensation (a redelivery and a watchdog re-dispatch, say).
    grab = {"server": "scratch", "tool": "grab", "operation": "release", "worker": settings}
    jobs = [plan(r, "order-9", "grab", {"gate": str(gate)}, dispatch=d, **grab) for d in (1, 2, 3)]
    r.hset(K.comp("order-9"), "grab", r.hget(K.comp("order-9"), "grab").replace(b'"dispatch":3', b'"dispatch":1'))
    workers = [start_worker(redis_url, config, f"w{i}", tmp_path / f"w{i}.log") for i in (1, 2)]
    log = Path(f"{gate}.log")
    try:

        def deferred_twice() -> bool:
            return sum(Job.exists(f"{j.job_id}-w2", connection=r) for j in jobs) == 2

        # One worker holds the lease inside the tool; the other two dispatches find it held, twice
        # each, and continue later without an attempt: with `attempts = 2` the old behaviour
        # (one retryable attempt per finding) would have spent every attempt they had.
        wait_for(lambda: log.exists() and deferred_twice(), timeout=60, what="one call in, two dispatches deferred")
        entered = log.read_text().splitlines()
        assert len(entered) == 1, entered
        assert reports(r, "order-9") == []  # no attempt reported, none counted
        holder = next(Job.fetch(j.job_id, connection=r) for j in jobs if not Job.exists(f"{j.job_id}-w1", connection=r))
        gate.touch()
        wait_for(lambda: holder.return_value(refresh=True) == "succeeded", what="the holder to finish")
        settle(r, "order-9", "grab")  # what the coordinator does with the holder's report
        queue = Queue(holder.origin, connection=r)
        wait_for(
            lambda: not (queue.count or queue.scheduled_job_registry.count or queue.started_job_registry.count),
            timeout=60,
            what="the continuations to find the compensation settled",
        )
    finally:
        for worker in workers:
            stop(worker)
    assert [kind for kind, _ in reports(r, "order-9")] == ["compensation-succeeded"]
    assert log.read_text().splitlines() == entered
