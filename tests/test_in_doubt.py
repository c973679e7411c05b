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
    from mcp_saga.schemas.events import WorkflowCompleted, entry_fields
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

    # A call the agent went on past and completed the workflow: its late result leaves nothing to undo.
    publish(started_entry("wf-2", "a", "svc", "do", {"n": 1}, recovery))
    publish(entry_fields("wf-2", WorkflowCompleted()))
    publish(step_entry("wf-2", "a", "svc", "do", {"n": 1}, {"structuredContent": {"id": "A"}}, recovery))
    done = comp_decoder.decode(r.hget(K.comp("wf-2"), "a"))
    assert (done.status, done.reason) == ("skipped", "settled after the workflow completed: nothing to undo")


def test_an_intent_recorded_without_its_arguments_is_never_called_again_and_a_late_result_undoes_it(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """A publisher of another language sends its intent's `arguments` as a JSON string (a common slip):
    decoding leaves them out, so the recorded call is not the one made. Re-calling the idempotent tool
    with what remains (`{}`) would be a call with guessed arguments; the step waits with the reason,
    and the call's own step-completed, arriving after the failure, undoes it."""
    port, db = free_port("127.0.0.1"), tmp_path / "inventory.db"
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.inventory", port, db))
    config = write_config(
        tmp_path / "saga.toml",
        {"inventory": {"url": url, "timeout": 5, "idempotent": ["reserve_inventory"]}},
        coordinator=COORDINATOR,
    )
    saga(procs, redis_url, config, tmp_path)
    arguments, key = {"sku": "A", "quantity": 2}, "ts-agent:cut-1:reserve"
    release = {
        "strategy": "compensation",
        "compensatingOperation": {
            "operationId": "release_inventory",
            "parameters": {"reservationId": "$response.body#/reservationId"},
        },
    }
    intent = {"step": "reserve", "server": "inventory", "tool": "reserve_inventory", "forwardKey": key}
    r.xadd(
        K.events,
        {
            "type": "step-started",
            "workflow": "cut-1",
            "data": msgspec.json.encode(
                {**intent, "arguments": msgspec.json.encode(arguments).decode(), "recovery": release}
            ),
        },
    )

    async def call() -> dict[str, Any]:
        async with Client(url) as inventory:
            result = await inventory.call_tool(
                "reserve_inventory", arguments, meta={"io.github.mcp-saga/idempotency-key": key}
            )
            return result.model_dump(by_alias=True, mode="json", exclude_none=True)

    result = anyio.run(call)  # the call was made, and its answer lost on the publisher's side
    r.xadd(K.events, {"type": "workflow-failed", "workflow": "cut-1", "data": b'{"reason":"lost","stepsCompleted":0}'})
    state = settled(r, "cut-1")
    assert state["status"] == "needs-attention", state
    assert "recorded without its arguments" in state["attention"], state["attention"]
    timeline = [e[1].get(b"type", b"").decode() for e in r.xrange(K.log("cut-1"))]
    assert "recall-dispatched" not in timeline, timeline
    assert [e["tool"] for e in read_state(db)["effects"]] == ["reserve_inventory"]  # called once: by the agent

    completed = {**intent, "arguments": arguments, "result": result, "recovery": release}
    del completed["forwardKey"]
    r.xadd(K.events, {"type": "step-completed", "workflow": "cut-1", "data": msgspec.json.encode(completed)})
    wait_for(lambda: r.hget(K.state("cut-1"), "status") == b"compensated", timeout=30, what="the late result's undo")
    [held] = holdings(db, "reservation")
    assert held["status"] == "released"


def test_a_refused_recall_leaves_the_step_in_doubt_and_the_unwind_halted_above_the_steps_below(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """An operator `saga retry`s an in-doubt charge without declaring the tool idempotent: the worker
    refuses the recall. Nothing was learned, so the step stays in doubt and still halts the unwind:
    the reservation below it is not released while the charge may still stand."""
    inventory_port, payments_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    inventory_db, payments_db = tmp_path / "inventory.db", tmp_path / "payments.db"
    inventory_url, payments_url = (f"http://127.0.0.1:{p}/mcp" for p in (inventory_port, payments_port))
    procs.append(serve("mcp_saga.examples.inventory", inventory_port, inventory_db))
    procs.append(serve("mcp_saga.examples.payments", payments_port, payments_db, "example.after-commit=sleep(1500)"))
    servers = {"inventory": {"url": inventory_url}, "payments": {"url": payments_url, "timeout": 5}}
    config = write_config(tmp_path / "saga.toml", servers, coordinator=COORDINATOR)
    saga(procs, redis_url, config, tmp_path)

    async def agent() -> None:
        async with (
            Client(inventory_url) as inventory,
            Client(payments_url) as payments,
            mcp_saga.workflow(
                "refused-1", redis=redis_url, servers={"inventory": inventory, "payments": payments}
            ) as wf,
        ):
            await wf.call("inventory", "reserve_inventory", {"sku": "A", "quantity": 1}, step="reserve")
            charge = {"orderId": "refused-1", "amount": 4}
            await wf.call("payments", "charge_payment", charge, step="charge", read_timeout_seconds=0.3)

    with pytest.raises(Exception):  # noqa: B017 - the SDK's timeout error
        anyio.run(agent)
    state = settled(r, "refused-1")
    assert "step charge: in-doubt" in state["attention"], state
    env = {**os.environ, "REDIS_URL": redis_url, "SAGA_CONFIG": str(config)}
    retry = [sys.executable, "-m", "mcp_saga.cli", "retry", "refused-1", "--step", "charge"]
    subprocess.run(retry, cwd=REPO, env=env, check=True, capture_output=True, timeout=60)

    def refused() -> dict[str, str] | None:
        entries = [{k.decode(): v.decode() for k, v in e[1].items()} for e in r.xrange(K.log("refused-1"))]
        return next((e for e in entries if e.get("type") == "compensation-refused"), None)

    assert "not declared idempotent" in wait_for(refused, timeout=30, what="the recall's refusal")["reason"]
    state = settled(r, "refused-1")
    assert state["status"] == "needs-attention"
    assert "step charge: in-doubt (in doubt, and its recall was refused" in state["attention"], state
    assert [h["status"] for h in holdings(inventory_db, "reservation")] == ["active"]  # halted above it
    assert [h["status"] for h in holdings(payments_db, "charge")] == ["charged"]


def test_the_callers_own_idempotency_key_is_the_forward_key_so_its_retry_does_not_repeat_the_effect(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """An agent that sends its own key in `_meta` and retries a call it timed out on: the server sees
    that key both times (one reservation), and both intents record it, as the gateway's do."""
    port, db = free_port("127.0.0.1"), tmp_path / "inventory.db"
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.inventory", port, db, "example.after-commit=sleep(1500)"))
    meta = {"io.github.mcp-saga/idempotency-key": "agent-order-9-reserve"}
    arguments = {"sku": "A", "quantity": 2}

    async def agent() -> None:
        async with (
            Client(url) as inventory,
            mcp_saga.workflow("own-key-1", redis=redis_url, servers={"inventory": inventory}) as wf,
        ):
            with pytest.raises(Exception):  # noqa: B017 - the SDK's timeout error
                await wf.call("inventory", "reserve_inventory", arguments, meta=meta, read_timeout_seconds=0.3)
            await wf.call("inventory", "reserve_inventory", arguments, meta=meta)

    anyio.run(agent)
    assert len(holdings(db, "reservation")) == 1  # the retry got the first call's result
    events = [msgspec.json.decode(e[1][b"data"]) for e in r.xrange(K.events) if e[1][b"workflow"] == b"own-key-1"]
    intents = [e["forwardKey"] for e in events if "forwardKey" in e]
    assert intents == ["agent-order-9-reserve"] * 2, events


def test_an_in_doubt_call_that_never_ran_is_recalled_and_its_error_answer_means_nothing_to_undo(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """The server is black-holed (SIGSTOP) while a call is on its way: the agent times out, the call
    dies with the server, unrun. The recall runs it now and the carrier refuses (`isError`): the step
    is skipped, saying so, and the shipment booked before it is still cancelled."""
    port, db = free_port("127.0.0.1"), tmp_path / "shipping.db"
    url = f"http://127.0.0.1:{port}/mcp"
    server = serve("mcp_saga.examples.shipping", port, db)
    config = write_config(
        tmp_path / "saga.toml",
        {"shipping": {"url": url, "timeout": 5, "idempotent": ["create_shipment"]}},
        coordinator=COORDINATOR,
    )

    async def agent() -> None:
        async with (
            Client(url) as shipping,
            mcp_saga.workflow("unrun-1", redis=redis_url, servers={"shipping": shipping}) as wf,
        ):
            await wf.call("shipping", "create_shipment", {"orderId": "unrun-1", "address": "1 Main St"}, step="first")
            server.send_signal(signal.SIGSTOP)
            refused = {"orderId": "unrun-1b", "address": "nowhere", "simulateFailure": True}
            await wf.call("shipping", "create_shipment", refused, step="second", read_timeout_seconds=0.5)

    with pytest.raises(Exception):  # noqa: B017 - the SDK's timeout error
        anyio.run(agent)
    server.kill()
    server.wait(10)
    procs.append(serve("mcp_saga.examples.shipping", port, db))
    saga(procs, redis_url, config, tmp_path)
    state = settled(r, "unrun-1")
    assert state["status"] == "compensated", state
    second = msgspec.json.decode(r.hget(K.comp("unrun-1"), "second"))
    assert second["status"] == "skipped"
    assert second["reason"].startswith("in doubt, and calling it again with its forward key returned an error"), second
    assert [h["status"] for h in holdings(db, "shipment")] == ["cancelled"]  # the refused one booked nothing


def test_in_doubt_steps_between_completed_ones_are_settled_in_lifo_order_and_an_operator_skip_resumes(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """Four calls: a reservation, a charge in doubt undone by order (request-only), a shipment, and a
    charge in doubt whose refund binds the response. The last halts the unwind at the top; once an
    operator skips it, the rest is undone last-first from the servers' own ledgers."""
    ports = {name: free_port("127.0.0.1") for name in ("inventory", "payments", "shipping")}
    urls = {name: f"http://127.0.0.1:{port}/mcp" for name, port in ports.items()}
    dbs = {name: tmp_path / f"{name}.db" for name in ports}
    for name, port in ports.items():
        failpoints = "example.after-commit=sleep(1500)" if name == "payments" else ""
        procs.append(serve(f"mcp_saga.examples.{name}", port, dbs[name], failpoints))
    servers = {name: {"url": url, "timeout": 5} for name, url in urls.items()}
    servers["orders"] = {"url": urls["payments"], "timeout": 5, "recovery": {"charge_payment": BY_ORDER}}
    config = write_config(tmp_path / "saga.toml", servers, coordinator=COORDINATOR)
    saga(procs, redis_url, config, tmp_path)

    async def agent() -> None:
        async with (
            Client(urls["inventory"]) as inventory,
            Client(urls["payments"]) as payments,
            Client(urls["payments"]) as orders,
            Client(urls["shipping"]) as shipping,
        ):
            clients = {"inventory": inventory, "payments": payments, "orders": orders, "shipping": shipping}
            async with mcp_saga.workflow("lifo-1", redis=redis_url, servers=clients) as wf:
                await wf.call("inventory", "reserve_inventory", {"sku": "A", "quantity": 1}, step="s1")
                with pytest.raises(Exception):  # noqa: B017 - the SDK's timeout error; the agent goes on
                    charge = {"orderId": "lifo-1", "amount": 3}
                    await wf.call("orders", "charge_payment", charge, step="s2", read_timeout_seconds=0.3)
                await wf.call("shipping", "create_shipment", {"orderId": "lifo-1", "address": "1 Main St"}, step="s3")
                charge = {"orderId": "lifo-1-b", "amount": 4}
                await wf.call("payments", "charge_payment", charge, step="s4", read_timeout_seconds=0.3)

    with pytest.raises(Exception):  # noqa: B017 - the last timeout fails the workflow
        anyio.run(agent)
    state = settled(r, "lifo-1")
    assert state["attention"] == (
        "step s4: in-doubt (in doubt: the outcome is unknown and the compensation binds the response)"
    ), state
    statuses = {s: msgspec.json.decode(r.hget(K.comp("lifo-1"), s))["status"] for s in ("s1", "s2", "s3", "s4")}
    assert statuses == {"s1": "pending", "s2": "pending", "s3": "pending", "s4": "in-doubt"}  # halted at the top
    env = {**os.environ, "REDIS_URL": redis_url, "SAGA_CONFIG": str(config)}
    skip = [sys.executable, "-m", "mcp_saga.cli", "skip", "lifo-1", "--step", "s4", "--note", "charge kept: checked"]
    subprocess.run(skip, cwd=REPO, env=env, check=True, capture_output=True, timeout=60)
    wait_for(lambda: r.hget(K.state("lifo-1"), "status") == b"compensated", timeout=60, what="the unwind")
    undone = sorted(
        (h["updatedAt"], name, h["data"].get("orderId"))
        for name, db in dbs.items()
        for h in read_state(db)["holdings"]
        if h["status"] in ("released", "refunded", "cancelled")
    )
    assert [(name, order) for _, name, order in undone] == [
        ("shipping", "lifo-1"),
        ("payments", "lifo-1"),
        ("inventory", None),
    ]
    assert {h["data"]["orderId"]: h["status"] for h in holdings(dbs["payments"], "charge")} == {
        "lifo-1": "refunded",
        "lifo-1-b": "charged",  # skipped by the operator
    }


def test_a_server_that_answers_nothing_times_the_first_call_out_within_its_read_timeout(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    """The intent needs the session's `tools/list`; from a black-holed server it never comes. The call's
    own read timeout still ends the call (it waited on that listing for ever), and since nothing was
    announced, nothing was sent: no intent, no call."""
    port, db = free_port("127.0.0.1"), tmp_path / "shipping.db"
    url = f"http://127.0.0.1:{port}/mcp"
    server = serve("mcp_saga.examples.shipping", port, db)
    procs.append(server)

    async def agent() -> None:
        async with (
            Client(url) as shipping,
            mcp_saga.workflow("hung-1", redis=redis_url, servers={"shipping": shipping}) as wf,
        ):
            server.send_signal(signal.SIGSTOP)
            with anyio.fail_after(20):  # a guard against the hang itself, twenty times the call's timeout
                shipment = {"orderId": "hung-1", "address": "1 Main St"}
                await wf.call("shipping", "create_shipment", shipment, read_timeout_seconds=1)

    with pytest.raises(TimeoutError, match="tools/list, which the intent of step '1-create_shipment' needs"):
        try:
            anyio.run(agent)
        except BaseExceptionGroup as group:  # the client's task groups wrap what the block raised
            leaf: BaseException = group
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            raise leaf from None
    server.send_signal(signal.SIGCONT)
    types = [e[1][b"type"] for e in r.xrange(K.events) if e[1][b"workflow"] == b"hung-1"]
    assert types == [b"workflow-failed"]  # no intent: the call was not made
    assert holdings(db, "shipment") == []
