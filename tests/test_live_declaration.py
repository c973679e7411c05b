"""Steps published with `recovery: null`, end to end: real redis-server, the example servers over
streamable HTTP, real coordinator and worker processes.

A publisher in another language whose client library strips `annotations.recovery` (the TypeScript
SDK's `listTools()` does) records each call with `recovery: null`. The workers read the servers' live
declarations at unwind, and the servers' own ledgers must show the charge refunded, then the
reservation released. A server that cannot be listed then is retried, and the workflow needs
attention with the reason, its unwind halted above the steps below, until an operator retries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from mcp import Client
from mcp_saga.cli.procs import free_port
from mcp_saga.examples.ledger import read_state
from mcp_saga.schemas.events import OperatorRetry, entry_fields
from mcp_saga.schemas.keys import Keys
from processes import saga_process, stop, stop_all, wait_for
from test_in_doubt import serve
from test_worker_job import write_config

K = Keys()
COORDINATOR = {"block_ms": 100, "watchdog_every": 0.2}
SERVERS = ("inventory", "payments", "shipping")


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.ports = {name: free_port("127.0.0.1") for name in SERVERS}
        self.dbs = {name: tmp_path / f"{name}.db" for name in SERVERS}
        self.procs: dict[str, Any] = {}
        self.saga: list[Any] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/mcp"

    def serve(self, name: str) -> None:
        self.procs[name] = serve(f"mcp_saga.examples.{name}", self.ports[name], self.dbs[name])

    def effects(self, name: str) -> list[dict[str, Any]]:
        return read_state(self.dbs[name])["effects"]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    found = World(tmp_path)
    yield found
    stop_all(*found.procs.values(), *found.saga)


def publish(r: redis.Redis, workflow: str, kind: str, data: dict[str, Any]) -> None:
    """A stream entry written by hand, as a publisher in another language writes it."""
    r.xadd(K.events, {"type": kind, "workflow": workflow, "data": json.dumps(data)})


def run_order(r: redis.Redis, world: World, workflow: str, before_failure: Callable[[], None] = lambda: None) -> None:
    """Reserve, charge, then a shipment the carrier refuses: each call recorded with `recovery: null`."""

    async def agent() -> None:
        calls = (
            ("reserve", "inventory", "reserve_inventory", {"sku": "A", "quantity": 2}),
            ("charge", "payments", "charge_payment", {"orderId": workflow, "amount": 12.5}),
        )
        for step, server, tool, arguments in calls:
            async with Client(world.url(server)) as client:
                result = await client.call_tool(tool, arguments)
            assert not result.is_error
            data = {
                "step": step,
                "server": server,
                "tool": tool,
                "arguments": arguments,
                "result": result.model_dump(by_alias=True, mode="json", exclude_none=True),
                "recovery": None,  # what a publisher reading tools/list through the TS SDK sends
            }
            publish(r, workflow, "step-completed", data)
        async with Client(world.url("shipping")) as shipping:
            refused = await shipping.call_tool(
                "create_shipment", {"orderId": workflow, "address": "x", "simulateFailure": True}
            )
        assert refused.is_error
        before_failure()
        failure = {"reason": "shipping refused", "failedStep": {"tool": "create_shipment"}, "stepsCompleted": 2}
        publish(r, workflow, "workflow-failed", failure)

    anyio.run(agent)


def settled(r: redis.Redis, workflow: str, timeout: float = 60) -> dict[str, str]:
    def state() -> dict[str, str] | None:
        raw = {k.decode(): v.decode() for k, v in r.hgetall(K.state(workflow)).items()}
        return raw if raw.get("status") in ("compensated", "needs-attention") else None

    return wait_for(state, timeout=timeout, what=f"{workflow} to settle")


def timeline(r: redis.Redis, workflow: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in r.xrange(K.log(workflow))]


def record(r: redis.Redis, workflow: str, step: str) -> dict[str, Any]:
    return json.loads(r.hget(K.comp(workflow), step) or b"{}")


def assert_refund_then_release(world: World) -> None:
    """The ledgers' own word: the charge refunded, then the reservation released."""
    refund = [e for e in world.effects("payments") if e["change"] == "refunded"]
    release = [e for e in world.effects("inventory") if e["change"] == "released"]
    assert len(refund) == 1 and len(release) == 1, (world.effects("payments"), world.effects("inventory"))
    assert refund[0]["at"] < release[0]["at"], "compensations ran in reverse completion order"


def test_steps_published_without_recovery_are_undone_from_the_live_declarations(
    r: redis.Redis, redis_url: str, world: World
) -> None:
    for name in SERVERS:
        world.serve(name)
    servers = {name: {"url": world.url(name), "timeout": 5} for name in ("inventory", "payments")}
    config = write_config(world.tmp_path / "saga.toml", servers, coordinator=COORDINATOR)
    for part in ("coordinator", "worker"):
        world.saga.append(saga_process(part, redis_url=redis_url, config=config, log=world.tmp_path / f"{part}.log"))
    run_order(r, world, "order-stripped")

    state = settled(r, "order-stripped")
    assert state["status"] == "compensated", state
    assert_refund_then_release(world)
    reads = [e for e in timeline(r, "order-stripped") if e["type"] == "declaration-read"]
    assert [e["step"] for e in reads] == ["charge", "reserve"]
    assert all("live declaration" in e["detail"] for e in reads)
    assert record(r, "order-stripped", "charge")["operationId"] == "refund_payment"


def test_a_server_that_cannot_be_listed_needs_attention_and_halts_until_retried(
    r: redis.Redis, redis_url: str, world: World
) -> None:
    for name in SERVERS:
        world.serve(name)
    servers = {name: {"url": world.url(name), "timeout": 2} for name in ("inventory", "payments")}
    worker = {"attempts": 2, "backoff_base": 0, "jitter": 0}
    config = write_config(world.tmp_path / "saga.toml", servers, coordinator=COORDINATOR, worker=worker)
    for part in ("coordinator", "worker"):
        world.saga.append(saga_process(part, redis_url=redis_url, config=config, log=world.tmp_path / f"{part}.log"))
    workflow = "order-unlisted"
    run_order(r, world, workflow, lambda: stop(world.procs["payments"]))  # gone when the unwind needs it

    state = settled(r, workflow)
    assert state["status"] == "needs-attention", state
    charge = record(r, workflow, "charge")
    assert (charge["status"], charge["kind"], charge["spent"]) == ("failed", "declaration", 2)
    assert "tools/list" in charge["lastError"] and "step charge: failed" in state["attention"]
    assert record(r, workflow, "reserve")["status"] == "pending"  # halted: nothing below it was undone
    assert not [e for e in world.effects("inventory") if e["change"] == "released"]

    world.serve("payments")
    r.xadd(K.events, entry_fields(workflow, OperatorRetry(step="charge", by="test")))
    state = wait_for(
        lambda: (s := settled(r, workflow))["status"] == "compensated" and s, timeout=60, what="the retried unwind"
    )
    assert_refund_then_release(world)
