"""In-doubt steps end to end: real redis-server, real example servers over streamable HTTP, real
coordinator and worker processes, the SDK as the agent (in a process of its own where it is killed).

Each test makes a forward call whose effect lands while the agent never learns its outcome, and
checks in the server's own ledger that the effect was undone, or that the workflow says why not:
- the server commits and dies (the connection drops): an idempotent tool is called again with the
  forward key, returns the first result, and that reservation is released;
- the agent times out while the server completes: the charge binds the response, so the workflow
  is `needs-attention` with the in-doubt reason; the same call undone by order (request-only) is refunded;
- the agent is SIGKILLed between intent and result: nobody signals the failure; after
  `in_doubt_after` the coordinator unwinds, and the charge is refunded by order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import redis
from mcp import Client
from mcp_saga.cli.procs import REPO, free_port, wait_until_accepting
from mcp_saga.examples.ledger import read_state
from mcp_saga.schemas.keys import Keys
from processes import saga_process, stop_all, wait_for
from test_worker_job import write_config

import mcp_saga

K = Keys()
BY_ORDER = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "refund_order", "parameters": {"orderId": "$request.body#/orderId"}},
}
COORDINATOR = {"block_ms": 100, "in_doubt_after": 2, "watchdog_every": 0.2}


def serve(module: str, port: int, db: Path, failpoints: str = "") -> subprocess.Popen[bytes]:
    env = {**os.environ, "SAGA_FAILPOINTS": failpoints}
    command = [sys.executable, "-m", module, "--http", str(port), "--db", str(db)]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    wait_until_accepting("127.0.0.1", port, proc, 20)
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_all(*started)


def saga(procs: list, redis_url: str, config: Path, tmp_path: Path) -> None:
    for part in ("coordinator", "worker"):
        procs.append(saga_process(part, redis_url=redis_url, config=config, log=tmp_path / f"{part}.log"))


def settled(r: redis.Redis, workflow: str, timeout: float = 60) -> dict[str, str]:
    def state() -> dict[str, str] | None:
        raw = {k.decode(): v.decode() for k, v in r.hgetall(K.state(workflow)).items()}
        return raw if raw.get("status") in ("compensated", "needs-attention") else None

    return wait_for(state, timeout=timeout, what=f"{workflow} to settle")


def holdings(db: Path, kind: str) -> list[dict[str, Any]]:
    return [h for h in read_state(db)["holdings"] if h["kind"] == kind]


def test_a_server_that_commits_then_drops_the_connection_is_recalled_and_undone(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    port, db = free_port("127.0.0.1"), tmp_path / "inventory.db"
    url = f"http://127.0.0.1:{port}/mcp"
    server = serve("mcp_saga.examples.inventory", port, db, "example.after-commit=kill")
    config = write_config(
        tmp_path / "saga.toml",
        {"inventory": {"url": url, "timeout": 5, "idempotent": ["reserve_inventory"]}},
        coordinator=COORDINATOR,
    )

    async def agent() -> None:
        async with (
            Client(url) as inventory,
            mcp_saga.workflow("drop-1", redis=redis_url, servers={"inventory": inventory}) as wf,
        ):
            await wf.call("inventory", "reserve_inventory", {"sku": "A", "quantity": 2})

    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises when the server dies
        anyio.run(agent)
    assert server.wait(10) == -signal.SIGKILL
    [held] = holdings(db, "reservation")
    assert held["status"] == "active"  # the effect landed; the agent never heard of it
    procs.append(serve("mcp_saga.examples.inventory", port, db))  # back, without the fault
    saga(procs, redis_url, config, tmp_path)
    state = settled(r, "drop-1")
    assert state["status"] == "compensated", state
    [held] = holdings(db, "reservation")  # the recall returned the first result: no second reservation
    assert held["status"] == "released"
    timeline = [e[1].get(b"type", b"").decode() for e in r.xrange(K.log("drop-1"))]
    assert "step-in-doubt" in timeline and "recall-succeeded" in timeline


def test_an_agent_timeout_while_the_server_completes_is_flagged_or_undone_by_request(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    port, db = free_port("127.0.0.1"), tmp_path / "payments.db"
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.payments", port, db, "example.after-commit=sleep(1500)"))
    servers = {"payments": {"url": url}, "orders": {"url": url, "recovery": {"charge_payment": BY_ORDER}}}
    config = write_config(tmp_path / "saga.toml", servers, coordinator=COORDINATOR)

    async def agent(workflow: str, server: str) -> None:
        async with (
            Client(url) as payments,
            mcp_saga.workflow(workflow, redis=redis_url, servers={server: payments}) as wf,
        ):
            await wf.call(server, "charge_payment", {"orderId": workflow, "amount": 5}, read_timeout_seconds=0.3)

    for workflow, server in (("late-1", "payments"), ("late-2", "orders")):
        with pytest.raises(Exception):  # noqa: B017 - the SDK's timeout error
            anyio.run(agent, workflow, server)
    wait_for(lambda: len(holdings(db, "charge")) == 2, timeout=10, what="both charges to land")
    saga(procs, redis_url, config, tmp_path)
    flagged, undone = settled(r, "late-1"), settled(r, "late-2")
    assert flagged["status"] == "needs-attention"
    assert "in doubt: the outcome is unknown and the compensation binds the response" in flagged["attention"]
    assert undone["status"] == "compensated", undone
    by_order = {h["data"]["orderId"]: h["status"] for h in holdings(db, "charge")}
    assert by_order == {"late-1": "charged", "late-2": "refunded"}


AGENT = textwrap.dedent(
    """
    import sys, anyio, mcp_saga
    from mcp import Client

    async def main(url, redis_url):
        async with Client(url) as payments:
            async with mcp_saga.workflow("killed-1", redis=redis_url, servers={"orders": payments}) as wf:
                await wf.call("orders", "charge_payment", {"orderId": "killed-1", "amount": 7})

    anyio.run(main, *sys.argv[1:])
    """
)


def test_an_agent_killed_between_intent_and_result_is_unwound_after_in_doubt_after(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    port, db = free_port("127.0.0.1"), tmp_path / "payments.db"
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.payments", port, db, "example.after-commit=sleep(30000)"))
    servers = {"orders": {"url": url, "recovery": {"charge_payment": BY_ORDER}}}
    config = write_config(tmp_path / "saga.toml", servers, coordinator=COORDINATOR)
    saga(procs, redis_url, config, tmp_path)
    agent = subprocess.Popen([sys.executable, "-c", AGENT, url, redis_url], cwd=REPO)
    procs.append(agent)
    wait_for(lambda: len(holdings(db, "charge")) == 1, timeout=20, what="the charge to land")
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    state = settled(r, "killed-1")
    assert state["status"] == "compensated", state
    assert "presumed gone" in state["reason"]
    [charge] = holdings(db, "charge")
    assert charge["status"] == "refunded"


def test_the_coordinator_records_intents_settles_them_and_watches_an_open_one(r: redis.Redis) -> None:
    """In one process against the real Redis: intents by the no-read path, their deadline, the settle."""
    from mcp_saga.coordinator.consumer import Coordinator
    from mcp_saga.runtime.publish import started_entry, step_entry, workflow_failed
    from mcp_saga.schemas.config import parse_config
    from mcp_saga.schemas.events import entry_fields
    from mcp_saga.schemas.records import comp_decoder

    coordinator = Coordinator(r, parse_config({"coordinator": {"block_ms": 10}}), name="t")
    coordinator.ensure_group()

    def publish(fields: dict) -> None:
        r.xadd(K.events, fields)
        while coordinator.step().events:
            pass

    def status(step: str) -> str:
        return comp_decoder.decode(r.hget(K.comp("wf-1"), step)).status

    undo = {"operationId": "undo", "parameters": {"id": "$response.body#/id"}}
    recovery = {"strategy": "compensation", "compensatingOperation": undo}
    publish(started_entry("wf-1", "a", "svc", "do", {"n": 1}, recovery))
    assert status("a") == "started" and r.zscore(K.deadlines, "wf-1") is not None  # watched while open
    publish(step_entry("wf-1", "a", "svc", "do", {"n": 1}, {"structuredContent": {"id": "A"}}, recovery))
    assert status("a") == "pending" and r.llen(K.steps("wf-1")) == 1  # settled in place
    assert msgspec.json.decode(r.lindex(K.steps("wf-1"), 0))["result"] == {"structuredContent": {"id": "A"}}
    publish(started_entry("wf-1", "b", "svc", "do", {"n": 2}, recovery))
    publish(entry_fields("wf-1", workflow_failed("transport error", steps_completed=1)))
    assert status("b") == "in-doubt" and status("a") == "pending"  # halted above a
    assert r.hget(K.state("wf-1"), "status") == b"needs-attention"
