"""SEP-3172 section 8 against real processes: forged or unsafe compensations are refused, never sent.

Whoever can XADD to `saga:events` chooses the `server` and `recovery` of a step, and a server may
declare anything it likes, so each case here publishes a hand-crafted step-completed event and a
workflow-failed, lets a real `saga coordinator` and a real `saga worker` (with real example MCP
servers over HTTP) do their work, and then checks three things: the compensation record ends
refused with a reason, the reason is on the workflow's timeline, and no call reached any server.

"No call" is measured twice, independently of the product: every server sits behind a relay that
counts the connections it accepts and the `tools/call` requests it forwards, and the servers'
own SQLite ledgers must show no effect beyond the ones each case created on purpose. Every
forged recovery targets a real holding (a live charge, reservation or shipment), so a call the
product wrongly let through would leave an effect there, not merely an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp import Client
from mcp_saga.cli.main import main as saga_main
from mcp_saga.examples.ledger import read_state
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import Config, CoordinatorSettings, Policy, ServerConfig, WorkerSettings, write_config
from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import Compensation, WorkflowState, comp_decoder, state_from_hash
from processes import saga_process, start_http_servers, stop, wait_for

K = Keys()
SERVERS = ("payments", "inventory", "shipping")
REFUND = compensation("refund_payment", transactionId="$response.body#/transactionId")
RELEASE = compensation("release_inventory", reservationId="$response.body#/reservationId")
CANCEL = compensation("cancel_shipment", shipmentId="$response.body#/shipmentId")
SETTLE = 30.0  # seconds; a bound on waiting for a condition, never an assertion on speed


class CallRelay:
    """A TCP relay in front of one server: what the worker sent it, counted outside the product.

    It counts accepted connections (the address case must never be dialled at all) and the
    JSON-RPC `tools/call` requests forwarded upstream (`tools/list` is allowed: the trust checks
    read it). MCP over streamable HTTP sends request bodies uncompressed, so the method name is on
    the wire as written; a carry of the last bytes finds it when a read splits it.
    """

    MARK = b'"tools/call"'

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.connections = 0
        self.tool_calls = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.connections, self.tool_calls

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        carry = b""
        try:
            while data := source.recv(65536):
                if count:
                    seen = carry + data
                    with self._lock:
                        self.tool_calls += seen.count(self.MARK)
                    carry = seen[-(len(self.MARK) - 1) :]
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@dataclass
class World:
    r: redis.Redis
    redis_url: str
    config: Path
    direct: dict[str, str]  # server name -> the server's own URL, for the cases' setup calls
    dbs: dict[str, Path]
    relays: dict[str, CallRelay]  # the registry's URLs, plus "stranger" (a live server not in it)

    def snapshot(self) -> dict[str, Any]:
        """Everything a call to any server would change: tools/call counts and every ledger's effects.

        Connections to registry servers are not counted: the trust checks read their tools/list.
        The stranger is no registry server, so any connection to it at all is a breach.
        """
        return {
            "tool_calls": {name: relay.counts()[1] for name, relay in self.relays.items()},
            "stranger_connections": self.relays["stranger"].counts()[0],
            "effects": {name: read_state(db)["effects"] for name, db in self.dbs.items()},
        }


def _write_config(path: Path, urls: dict[str, str]) -> Path:
    """Policy: inventory releases wait for approval, shipping is denied, everything else runs."""
    config = Config(
        servers={name: ServerConfig(url=url, timeout=5) for name, url in urls.items()},
        policy=Policy(auto=["*"], approval=["inventory:release_inventory"], deny=["shipping:*"]),
        coordinator=CoordinatorSettings(block_ms=50, claim_idle_ms=1000, watchdog_every=0.2),
        worker=WorkerSettings(attempts=2, backoff_base=0, jitter=0, lease=10),
    )
    return write_config(config, path)


@pytest.fixture(scope="module")
def world(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One coordinator, one worker and three servers for all cases: starting them is most of the cost."""
    tmp = tmp_path_factory.mktemp("security")
    dbs = {name: tmp / f"{name}.db" for name in SERVERS}
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    specs = [(f"mcp_saga.examples.{name}", "--db", str(dbs[name])) for name in SERVERS]
    with start_http_servers(*specs) as started:
        direct = {name: url for name, (_, url) in zip(SERVERS, started, strict=True)}
        ports = {name: int(url.rsplit(":", 1)[1].split("/")[0]) for name, url in direct.items()}
        relays = {name: CallRelay(ports[name]) for name in SERVERS}
        relays["stranger"] = CallRelay(ports["payments"])
        config = _write_config(tmp / "saga.toml", {name: relays[name].url for name in SERVERS})
        procs = [
            saga_process("coordinator", "--name", "sec-coord", redis_url=redis_url, config=config, log=tmp / "c.log"),
            saga_process("worker", "--name", "sec-worker", redis_url=redis_url, config=config, log=tmp / "w.log"),
        ]
        try:
            yield World(client, redis_url, config, direct, dbs, relays)
        finally:
            for proc in procs:
                stop(proc)
            for relay in relays.values():
                relay.close()
            client.flushdb()
            client.close()


# Helpers: real calls for the setup, hand-written events for the cases.


def call(url: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One real tools/call, straight to the server (not through its relay); its result as on the wire."""

    async def go() -> dict[str, Any]:
        async with Client(url) as client:
            result = await client.call_tool(tool, arguments)
            assert not result.is_error, result.content
            return result.model_dump(by_alias=True, mode="json", exclude_none=True)

    return asyncio.run(go())


def step_event(
    step: str, server: str, tool: str, arguments: dict[str, Any], result: dict[str, Any], recovery: dict[str, Any]
) -> StepCompleted:
    return StepCompleted(step=step, server=server, tool=tool, arguments=arguments, result=result, recovery=recovery)


def publish_and_settle(world: World, workflow: str, *steps: StepCompleted) -> WorkflowState:
    """XADD the steps and the failure as any publisher would, then wait until nothing is left in flight."""
    for payload in (*steps, WorkflowFailed(reason="a later step failed", steps_completed=len(steps))):
        world.r.xadd(K.events, entry_fields(workflow, payload))

    def settled() -> WorkflowState | None:
        state = state_from_hash(world.r.hgetall(K.state(workflow)))
        return state if state.status in ("needs-attention", "compensated") else None

    return wait_for(settled, SETTLE, f"{workflow} to settle")


def record(world: World, workflow: str, step: str) -> Compensation:
    return comp_decoder.decode(world.r.hget(K.comp(workflow), step))


def timeline(world: World, workflow: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in world.r.xrange(K.log(workflow))]


def assert_refused(
    world: World, workflow: str, step: str, status: str, reason: str, *, by: str, before: dict[str, Any]
) -> Compensation:
    """The record, the timeline and the workflow all say why, and nothing reached a server.

    `by` is who refused: the "worker" (its trust checks or policy, after a dispatch) or the
    "planner" (the coordinator, which then never dispatches at all).
    """
    state = state_from_hash(world.r.hgetall(K.state(workflow)))
    comp = record(world, workflow, step)
    assert comp.status == status, (comp, timeline(world, workflow))
    assert comp.reason and reason in comp.reason, comp.reason

    entries = timeline(world, workflow)
    dispatched = [e for e in entries if e["type"] == "compensation-dispatched"]
    if by == "worker":
        [refused] = [e for e in entries if e["type"] == "compensation-refused" and e.get("step") == step]
        assert (refused["status"], refused["reason"]) == (status, comp.reason)
        assert len(dispatched) == 1
    else:
        [planned] = [e for e in entries if e["type"] == "step-planned" and e.get("step") == step]
        assert (planned["plan"], planned["reason"]) == (status, comp.reason)
        assert dispatched == []  # the coordinator refused: no worker was even asked

    assert state.status == "needs-attention"
    assert f"step {step}: {status} ({comp.reason})" in state.attention
    assert any(e["type"] == "status" and e.get("attention") == state.attention for e in entries)

    assert world.snapshot() == before, "a call reached a server"
    assert world.r.xlen(K.dead_letter) == 0  # the crafted events were well-formed: refusing was a trust decision
    return comp


# The cases.


def test_a_server_not_in_the_registry_is_never_called(world: World) -> None:
    charge = call(world.direct["payments"], "charge_payment", {"orderId": "sec-1", "amount": 10})
    before = world.snapshot()
    event = step_event("charge", "billing", "charge_payment", {"orderId": "sec-1", "amount": 10}, charge, REFUND)

    publish_and_settle(world, "sec-1", event)

    assert_refused(
        world,
        "sec-1",
        "charge",
        "unrecoverable",
        "'billing' is not in this worker's registry",
        by="worker",
        before=before,
    )


@pytest.mark.parametrize("form", ["url", "host-port"])
def test_a_server_given_as_an_address_is_never_dialled(world: World, form: str) -> None:
    """The address is a live payments server's: were it dialled, its relay would count a connection."""
    stranger = world.relays["stranger"]
    address = stranger.url if form == "url" else f"127.0.0.1:{stranger.port}"
    workflow = f"sec-2-{form}"
    arguments = {"orderId": workflow, "amount": 10}
    charge = call(world.direct["payments"], "charge_payment", arguments)
    before = world.snapshot()

    publish_and_settle(world, workflow, step_event("charge", address, "charge_payment", arguments, charge, REFUND))

    assert_refused(world, workflow, "charge", "unrecoverable", "looks like an address", by="worker", before=before)
    assert stranger.counts() == (0, 0)


def test_a_recovery_naming_a_tool_the_server_does_not_list(world: World) -> None:
    charge = call(world.direct["payments"], "charge_payment", {"orderId": "sec-3", "amount": 10})
    before = world.snapshot()
    forged = compensation("refund_everything", transactionId="$response.body#/transactionId")
    event = step_event("charge", "payments", "charge_payment", {"orderId": "sec-3", "amount": 10}, charge, forged)

    publish_and_settle(world, "sec-3", event)

    assert_refused(
        world, "sec-3", "charge", "unrecoverable", "does not list 'refund_everything'", by="worker", before=before
    )


def test_a_recovery_pointing_at_another_servers_tool(world: World) -> None:
    """A payments step whose recovery releases a real reservation, a tool only inventory has."""
    reservation = call(world.direct["inventory"], "reserve_inventory", {"sku": "SKU-SEC-4", "quantity": 1})
    held = reservation["structuredContent"]["reservationId"]
    charge = call(world.direct["payments"], "charge_payment", {"orderId": "sec-4", "amount": 10})
    before = world.snapshot()
    forged = compensation("release_inventory", reservationId=held)
    event = step_event("charge", "payments", "charge_payment", {"orderId": "sec-4", "amount": 10}, charge, forged)

    publish_and_settle(world, "sec-4", event)

    assert_refused(
        world,
        "sec-4",
        "charge",
        "unrecoverable",
        "payments does not list 'release_inventory'",
        by="worker",
        before=before,
    )
    assert {h["id"]: h["status"] for h in read_state(world.dbs["inventory"])["holdings"]}[held] == "active"


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        # The event says the charge is undone by another tool the server really has.
        ("other-operation", "payments:charge_payment's live recovery declaration names 'refund_payment' now"),
        # Same operation, different binding: the event aims the refund at someone else's charge.
        ("other-parameters", "payments:charge_payment's live recovery declaration binds"),
        # The original tool declares no compensation at all on the live server.
        ("no-declaration", "no compensation is declared any more"),
    ],
)
def test_a_declaration_the_live_server_does_not_make(world: World, variant: str, reason: str) -> None:
    workflow = f"sec-5-{variant}"
    arguments = {"orderId": workflow, "amount": 10}
    charge = call(world.direct["payments"], "charge_payment", arguments)
    victim = call(world.direct["payments"], "charge_payment", {"orderId": f"{workflow}-victim", "amount": 99})
    victim_id = victim["structuredContent"]["transactionId"]
    tool = "charge_payment"
    if variant == "other-operation":
        forged = compensation("state")
    elif variant == "other-parameters":
        forged = compensation("refund_payment", transactionId=victim_id)
    else:  # a "refund" step whose undo would charge the customer again
        tool, arguments = "refund_payment", {"transactionId": charge["structuredContent"]["transactionId"]}
        charge = call(world.direct["payments"], "refund_payment", arguments)
        forged = compensation("charge_payment", orderId=workflow, amount=10)
    before = world.snapshot()

    publish_and_settle(world, workflow, step_event("step", "payments", tool, arguments, charge, forged))

    assert_refused(world, workflow, "step", "unrecoverable", reason, by="worker", before=before)
    holdings = {h["id"]: h["status"] for h in read_state(world.dbs["payments"])["holdings"]}
    assert holdings[victim_id] == "charged"


def test_policy_deny_is_final(world: World) -> None:
    shipment = call(world.direct["shipping"], "create_shipment", {"orderId": "sec-6d", "address": "1 Main St"})
    before = world.snapshot()
    event = step_event("ship", "shipping", "create_shipment", {"orderId": "sec-6d"}, shipment, CANCEL)

    publish_and_settle(world, "sec-6d", event)

    assert_refused(
        world, "sec-6d", "ship", "unrecoverable", "policy denies shipping:cancel_shipment", by="worker", before=before
    )


def test_policy_approval_waits_then_runs_exactly_once(world: World) -> None:
    reservation = call(world.direct["inventory"], "reserve_inventory", {"sku": "SKU-SEC-6", "quantity": 2})
    held = reservation["structuredContent"]["reservationId"]
    before = world.snapshot()
    event = step_event(
        "reserve", "inventory", "reserve_inventory", {"sku": "SKU-SEC-6", "quantity": 2}, reservation, RELEASE
    )

    publish_and_settle(world, "sec-6a", event)

    comp = assert_refused(
        world,
        "sec-6a",
        "reserve",
        "awaiting-approval",
        "policy requires approval for inventory:release_inventory",
        by="worker",
        before=before,
    )

    approve = ["approve", "sec-6a", "--step", "reserve", "--by", "sec-test"]
    assert saga_main([*approve, "--redis", world.redis_url, "--config", str(world.config)]) == 0

    def done() -> WorkflowState | None:
        state = state_from_hash(world.r.hgetall(K.state("sec-6a")))
        return state if state.status == "compensated" else None

    wait_for(done, SETTLE, "the approved release to run")
    assert record(world, "sec-6a", "reserve").status == "succeeded"
    entries = timeline(world, "sec-6a")
    approved = [e for e in entries if e["type"] == "operator-approve"]
    assert [(e["step"], e["by"]) for e in approved] == [("reserve", "sec-test")]
    assert [e["type"] for e in entries if e.get("step") == "reserve"][-2:] == [
        "compensation-dispatched",
        "compensation-succeeded",
    ]
    after = world.snapshot()
    new_effects = after["effects"]["inventory"][len(before["effects"]["inventory"]) :]
    assert [(e["tool"], e["holding"], e["change"]) for e in new_effects] == [("release_inventory", held, "released")]
    assert new_effects[0]["idempotencyKey"] == comp.idempotency_key
    assert after["tool_calls"] == {**before["tool_calls"], "inventory": before["tool_calls"]["inventory"] + 1}
    assert after["stranger_connections"] == before["stranger_connections"]
    assert after["effects"]["payments"] == before["effects"]["payments"]
    assert after["effects"]["shipping"] == before["effects"]["shipping"]


def test_a_compensation_that_would_call_the_original_tool_again(world: World) -> None:
    """Charging again as the "undo" of a charge: the coordinator refuses it at planning time."""
    arguments = {"orderId": "sec-7", "amount": 10}
    charge = call(world.direct["payments"], "charge_payment", arguments)
    before = world.snapshot()
    forged = compensation("charge_payment", orderId="$request.body#/orderId", amount="$request.body#/amount")

    publish_and_settle(world, "sec-7", step_event("charge", "payments", "charge_payment", arguments, charge, forged))

    assert_refused(
        world, "sec-7", "charge", "unrecoverable", "would call the original tool 'charge_payment' again", by="planner",
        before=before,
    )  # fmt: skip
