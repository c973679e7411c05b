"""The demo servers as real processes: tools, recovery declarations, idempotency, fault injection.

Effects are counted in each server's SQLite ledger, read from this process while the server runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_saga.examples import SERVERS, TRIVIAL
from mcp_saga.examples.ledger import DB_ENV, FAIL_RATE_ENV, TRANSIENT_PREFIX, db_path, read_state
from mcp_saga.examples.serve import parse_args
from mcp_saga.examples.shipping import SIMULATED_FAILURE
from mcp_saga.runtime.recovery_wire import (
    IDEMPOTENCY_ARGUMENT,
    IDEMPOTENCY_META_KEY,
    compensation,
    read_tool_declarations,
)
from mcp_types import CallToolResult
from processes import start_http_servers, stdio_params

RECOVERY = {
    "inventory": (
        "reserve_inventory",
        compensation("release_inventory", reservationId="$response.body#/reservationId"),
    ),
    "payments": ("charge_payment", compensation("refund_payment", transactionId="$response.body#/transactionId")),
    "shipping": ("create_shipment", compensation("cancel_shipment", shipmentId="$response.body#/shipmentId")),
}
FAIL_FIRST = 2


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, Path]]]:
    """name -> (url, db) for the three servers, plus `flaky`: inventory with --fail-first."""
    directory = tmp_path_factory.mktemp("ledgers")
    dbs = {name: directory / f"{name}.db" for name in [*SERVERS, "flaky"]}
    specs = [(module, "--db", str(dbs[name])) for name, module in SERVERS.items()]
    specs.append((SERVERS["inventory"], "--db", str(dbs["flaky"]), "--fail-first", str(FAIL_FIRST)))
    with start_http_servers(*specs) as started:
        yield {name: (url, dbs[name]) for name, (_, url) in zip(dbs, started, strict=True)}


@pytest.fixture(scope="module")
async def clients(servers: dict[str, tuple[str, Path]]) -> AsyncIterator[dict[str, Client]]:
    async with (
        Client(servers["inventory"][0]) as inventory,
        Client(servers["payments"][0]) as payments,
        Client(servers["shipping"][0]) as shipping,
        Client(servers["flaky"][0]) as flaky,
    ):
        yield {"inventory": inventory, "payments": payments, "shipping": shipping, "flaky": flaky}


def ok(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, result.content
    return result.structured_content


def error_text(result: CallToolResult) -> str:
    assert result.is_error, result.structured_content
    return result.content[0].text


def effects(db: Path, **match: Any) -> list[dict[str, Any]]:
    return [e for e in read_state(db)["effects"] if all(e[k] == v for k, v in match.items())]


pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("name", list(SERVERS))
async def test_each_server_declares_its_compensation(clients: dict[str, Client], name: str) -> None:
    tools = await read_tool_declarations(clients[name])
    forward, recovery = RECOVERY[name]
    undo = recovery["compensatingOperation"]["operationId"]

    assert (tools[forward].recovery, tools[forward].recovery_source, tools[forward].problem) == (
        recovery,
        "annotations",
        None,
    )
    assert tools[undo].recovery is None and tools[undo].declares_argument(IDEMPOTENCY_ARGUMENT)
    assert tools["state"].annotations["readOnlyHint"] is True


async def test_inventory_reserves_and_releases(clients: dict[str, Client], servers: dict) -> None:
    inventory = clients["inventory"]
    reserved = ok(await inventory.call_tool("reserve_inventory", {"sku": "SKU-1", "quantity": 3}))
    rid = reserved["reservationId"]

    assert reserved == {"reservationId": rid, "sku": "SKU-1", "quantity": 3}
    released = ok(await inventory.call_tool("release_inventory", {"reservationId": rid}))
    assert released == {"reservationId": rid, "sku": "SKU-1", "quantity": 3, "status": "released"}
    assert "already released" in error_text(await inventory.call_tool("release_inventory", {"reservationId": rid}))
    assert "unknown reservation" in error_text(
        await inventory.call_tool("release_inventory", {"reservationId": "RSV-NOPE"})
    )
    assert [e["change"] for e in effects(servers["inventory"][1], holding=rid)] == ["active", "released"]


async def test_payments_charges_and_refunds(clients: dict[str, Client], servers: dict) -> None:
    payments = clients["payments"]
    charged = ok(await payments.call_tool("charge_payment", {"orderId": "order-1", "amount": 59.97}))
    txn = charged["transactionId"]

    assert charged == {
        "transactionId": txn,
        "orderId": "order-1",
        "amount": 59.97,
        "currency": "USD",
        "status": "charged",
    }
    refunded = ok(await payments.call_tool("refund_payment", {"transactionId": txn}))
    assert (refunded["transactionId"], refunded["amount"], refunded["status"]) == (txn, 59.97, "refunded")
    assert "already refunded" in error_text(await payments.call_tool("refund_payment", {"transactionId": txn}))
    summary = (await payments.call_tool("state", {})).structured_content["summary"]
    assert summary["charge"]["refunded"] >= 1


async def test_shipping_fails_when_told_and_changes_nothing(clients: dict[str, Client], servers: dict) -> None:
    shipping, db = clients["shipping"], servers["shipping"][1]
    before = len(read_state(db)["effects"])
    failed = await shipping.call_tool(
        "create_shipment", {"orderId": "order-2", "address": "1 Main St", "simulateFailure": True}
    )

    assert SIMULATED_FAILURE in error_text(failed)
    assert len(read_state(db)["effects"]) == before
    shipment = ok(await shipping.call_tool("create_shipment", {"orderId": "order-2", "address": "1 Main St"}))
    cancelled = ok(await shipping.call_tool("cancel_shipment", {"shipmentId": shipment["shipmentId"]}))
    assert cancelled["status"] == "cancelled"


async def test_a_repeated_key_returns_the_first_result_and_applies_once(
    clients: dict[str, Client], servers: dict
) -> None:
    inventory, db = clients["inventory"], servers["inventory"][1]
    meta = {IDEMPOTENCY_META_KEY: "order-3:reserve"}
    first = ok(await inventory.call_tool("reserve_inventory", {"sku": "SKU-3", "quantity": 1}, meta=meta))
    again = ok(await inventory.call_tool("reserve_inventory", {"sku": "SKU-3", "quantity": 1}, meta=meta))

    assert again == first
    assert len(effects(db, idempotencyKey="order-3:reserve")) == 1
    release = {"reservationId": first["reservationId"], IDEMPOTENCY_ARGUMENT: "order-3:release"}
    released = [ok(await inventory.call_tool("release_inventory", release)) for _ in range(3)]
    assert released[1:] == released[:1] * 2  # a repeat is not "already released": it is the same call
    assert len(effects(db, idempotencyKey="order-3:release")) == 1


async def test_concurrent_calls_with_one_key_apply_once(clients: dict[str, Client], servers: dict) -> None:
    payments, db = clients["payments"], servers["payments"][1]
    charge, refund = ({IDEMPOTENCY_META_KEY: f"order-4:{step}"} for step in ("charge", "refund"))
    charges = await asyncio.gather(
        *(payments.call_tool("charge_payment", {"orderId": "order-4", "amount": 5}, meta=charge) for _ in range(5))
    )
    [txn] = {ok(result)["transactionId"] for result in charges}
    refunds = await asyncio.gather(
        *(payments.call_tool("refund_payment", {"transactionId": txn}, meta=refund) for _ in range(5))
    )

    assert len({ok(result)["refundId"] for result in refunds}) == 1
    assert [e["change"] for e in effects(db, holding=txn)] == ["charged", "refunded"]


async def test_fail_first_fails_then_succeeds_before_any_effect(clients: dict[str, Client], servers: dict) -> None:
    flaky, db = clients["flaky"], servers["flaky"][1]
    rid = ok(await flaky.call_tool("reserve_inventory", {"sku": "SKU-5", "quantity": 2}))["reservationId"]
    meta = {IDEMPOTENCY_META_KEY: "order-5:release"}
    attempts = [await flaky.call_tool("release_inventory", {"reservationId": rid}, meta=meta) for _ in range(4)]

    assert all(TRANSIENT_PREFIX in error_text(result) for result in attempts[:FAIL_FIRST])
    assert ok(attempts[FAIL_FIRST]) == ok(attempts[FAIL_FIRST + 1])
    assert [e["change"] for e in effects(db, holding=rid)] == ["active", "released"]


async def test_fail_rate_from_the_environment_over_stdio(tmp_path: Path) -> None:
    db = tmp_path / "inventory.db"
    params = stdio_params(SERVERS["inventory"], env={DB_ENV: str(tmp_path), FAIL_RATE_ENV: "1"})
    async with Client(params) as inventory:
        rid = ok(await inventory.call_tool("reserve_inventory", {"sku": "SKU-6", "quantity": 1}))["reservationId"]
        results = [await inventory.call_tool("release_inventory", {"reservationId": rid}) for _ in range(3)]

    assert all(TRANSIENT_PREFIX in error_text(result) for result in results)
    assert read_state(db)["summary"] == {"reservation": {"active": 1}}


async def test_trivial_server_for_benchmarks() -> None:
    async with Client(stdio_params(TRIVIAL, "--fail-first", "1")) as trivial:
        tools = await read_tool_declarations(trivial)
        assert tools["noop"].recovery == compensation("noop_undo", n="$response.body#/n")
        assert ok(await trivial.call_tool("noop", {"n": 7})) == {"n": 7}
        assert TRANSIENT_PREFIX in error_text(await trivial.call_tool("noop_undo", {"n": 7}))
        assert ok(await trivial.call_tool("noop_undo", {"n": 7})) == {"n": 7, "undone": True}


def test_command_line_and_db_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DB_ENV, str(tmp_path))
    assert db_path("payments") == tmp_path / "payments.db"
    assert db_path("payments", tmp_path / "own.db") == tmp_path / "own.db"
    monkeypatch.setenv(FAIL_RATE_ENV, "0.25")
    args = parse_args("payments", ["--http", "8001", "--fail-first", "3"])
    assert (args.http, args.host, args.faults.rate, args.faults.first) == (8001, "127.0.0.1", 0.25, 3)
    with pytest.raises(SystemExit):
        parse_args("payments", ["--fail-rate", "2"])
