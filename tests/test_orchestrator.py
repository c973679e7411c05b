"""The orchestrator SDK against real example servers and a real Redis: what lands on `saga:events`.

Every entry the SDK writes is read back through the coordinator's own gate (`decode_entry`), and
the scenarios that should start an unwind are folded by an in-process coordinator, so "the
coordinator accepts it" is checked by the coordinator rather than assumed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import mcp_saga.orchestrator.wrapper as sdk
import msgspec
import pytest
import redis
import redis.asyncio as aioredis
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.examples import SERVERS
from mcp_saga.examples.shipping import SIMULATED_FAILURE
from mcp_saga.runtime.pipelined import Pipelined, shared_pipelined
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool
from mcp_saga.schemas.config import RedisSettings, parse_config
from mcp_saga.schemas.events import Event, FailedStep, StepCompleted, WorkflowCompleted, WorkflowFailed, decode_entry
from mcp_saga.schemas.expressions import CUT_META_KEY
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import forward_key
from mcp_saga.schemas.recovery import parse_recovery
from mcp_types import CallToolResult, TextContent
from processes import start_http_servers, stdio_params
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.credentials import UsernamePasswordCredentialProvider

import mcp_saga

pytestmark = pytest.mark.anyio
K = Keys()
DECLARED = {
    "reserve_inventory": compensation("release_inventory", reservationId="$response.body#/reservationId"),
    "charge_payment": compensation("refund_payment", transactionId="$response.body#/transactionId"),
    "create_shipment": compensation("cancel_shipment", shipmentId="$response.body#/shipmentId"),
}
ORDER = [
    ("inventory", "reserve_inventory", {"sku": "WIDGET-1", "quantity": 2}),
    ("payments", "charge_payment", {"orderId": "order-42", "amount": 19.5}),
    ("shipping", "create_shipment", {"orderId": "order-42", "address": "1 Main St"}),
]
FAILING_SHIPMENT = ("shipping", "create_shipment", {"orderId": "order-42", "address": "x", "simulateFailure": True})


class Boom(Exception):
    pass


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    directory = tmp_path_factory.mktemp("ledgers")
    specs = [(module, "--db", str(directory / f"{name}.db")) for name, module in SERVERS.items()]
    with start_http_servers(*specs) as started:
        yield {name: url for name, (_, url) in zip(SERVERS, started, strict=True)}


@pytest.fixture(scope="module")
async def clients(urls: dict[str, str]) -> AsyncIterator[dict[str, Client]]:
    async with (
        Client(urls["inventory"]) as inventory,
        Client(urls["payments"]) as payments,
        Client(urls["shipping"]) as shipping,
    ):
        yield {"inventory": inventory, "payments": payments, "shipping": shipping}


@pytest.fixture
async def ar(r: redis.Redis, redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def events(r: redis.Redis, keys: Keys = K, *, intents: bool = False) -> list[Event]:
    """The stream's events; without the intents unless asked (tests/test_in_doubt.py covers them): each
    step-started, and the step-completed with an `isError` result that settles the intent of a failed call."""
    found = [decode_entry(i.decode(), fields) for i, fields in r.xrange(keys.events)]
    return [e for e in found if intents or not _intent_traffic(e)]


def _intent_traffic(event: Event) -> bool:
    if event.type == "step-started":
        return True
    return event.type == "step-completed" and event.data.result.get("isError") is True


def unwind(r: redis.Redis) -> Coordinator:
    coordinator = Coordinator(r, parse_config({"coordinator": {"block_ms": 10}}), name="test")
    coordinator.ensure_group()
    while coordinator.step().events:
        pass
    assert r.xlen(K.dead_letter) == 0
    return coordinator


def comp(r: redis.Redis, workflow: str, step: str) -> dict[str, Any]:
    return msgspec.json.decode(r.hget(K.comp(workflow), step))


async def test_clean_block_publishes_each_step_then_completed(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    listings = []

    async def counting(client: Client) -> Any:
        listings.append(client)
        return await real(client)

    real = sdk.read_tool_declarations
    monkeypatch.setattr(sdk, "read_tool_declarations", counting)
    for client in clients.values():
        mcp_saga.forget_declarations(client)
    for n in (1, 2):
        async with mcp_saga.workflow(f"order-{n}", redis=ar, servers=clients) as wf:
            results = [await wf.call(*call) for call in ORDER]
        assert wf.steps_completed == 3

    assert len(listings) == 3  # one tools/list per client, shared by both workflows
    published = [e for e in events(r) if e.workflow == "order-2"]
    assert [e.type for e in published] == ["step-completed"] * 3 + ["workflow-completed"]
    for event, (server, tool, arguments), result, n in zip(published, ORDER, results, (1, 2, 3), strict=False):
        step = event.data
        assert isinstance(step, StepCompleted)
        assert (step.step, step.server, step.tool, step.arguments) == (f"{n}-{tool}", server, tool, arguments)
        assert step.recovery == DECLARED[tool]  # as the server lists it, not from anywhere in this test's code
        assert step.result == result.model_dump(by_alias=True, mode="json", exclude_none=True)
        assert step.result["structuredContent"]["orderId" if server != "inventory" else "sku"]
        assert step.annotations == {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False}
        assert isinstance(step.completed_at, str) and step.completed_at.endswith("Z")
    unwind(r)
    assert r.hget(K.state("order-2"), "status") == b"completed"


async def test_raising_block_publishes_failed_and_reraises_the_same_exception(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    boom = Boom("the model changed its mind")
    with pytest.raises(Boom) as raised:
        async with mcp_saga.workflow("order-boom", redis=ar, servers=clients) as wf:
            for call in ORDER[:2]:
                await wf.call(*call)
            raise boom
    assert raised.value is boom
    *steps, failed = events(r)
    assert [e.data.step for e in steps] == ["1-reserve_inventory", "2-charge_payment"]
    assert failed.data == WorkflowFailed(reason="Boom: the model changed its mind", steps_completed=2)

    unwind(r)  # the events drive a real unwind plan: last step first
    assert r.hget(K.state("order-boom"), "status") == b"compensating"
    charge = comp(r, "order-boom", "2-charge_payment")
    assert (charge["status"], charge["operationId"]) == ("queued", "refund_payment")
    assert charge["arguments"]["transactionId"] == steps[1].data.result["structuredContent"]["transactionId"]
    reserve = comp(r, "order-boom", "1-reserve_inventory")  # behind the refund, in its routing slip
    assert reserve["status"] == "queued" and reserve["via"]


async def test_an_is_error_call_is_not_a_step_and_fails_the_block(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    with pytest.raises(mcp_saga.ToolCallFailed) as raised:
        async with mcp_saga.workflow(
            "order-err", redis=ar, servers=clients, parallel=True, on_failure="continue"
        ) as wf:
            for call in [*ORDER[:2], FAILING_SHIPMENT]:
                await wf.call(*call)
    assert raised.value.result.is_error and SIMULATED_FAILURE in str(raised.value)
    failure = raised.value
    assert (failure.server, failure.tool, failure.step) == ("shipping", "create_shipment", "3-create_shipment")
    *steps, failed = events(r)
    assert [e.data.tool for e in steps] == ["reserve_inventory", "charge_payment"]
    assert failed.data.steps_completed == 2 and failed.data.reason.startswith("ToolCallFailed: ")
    assert failed.data.failed_step.tool == "create_shipment" and SIMULATED_FAILURE in failed.data.failed_step.error
    assert (failed.data.parallel, failed.data.on_failure) == (True, "continue")
    unwind(r)
    assert {comp(r, "order-err", s.data.step)["status"] for s in steps} == {"queued"}  # parallel: both at once


async def test_a_caught_failure_can_be_retried_under_its_step_id(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    async with mcp_saga.workflow("order-retry", redis=ar, servers=clients) as wf:
        with pytest.raises(mcp_saga.ToolCallFailed):
            await wf.call(*FAILING_SHIPMENT, step="ship")
        await wf.call(*ORDER[2], step="ship")
        with pytest.raises(ValueError, match="already used"):
            await wf.call(*ORDER[2], step="ship")
    assert [(e.type, getattr(e.data, "step", None)) for e in events(r)] == [
        ("step-completed", "ship"),
        ("workflow-completed", None),
    ]


async def test_a_failure_while_calls_are_in_flight_counts_them(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    """gather() raises at the first failure while its siblings still run: the exit waits for them."""
    with pytest.raises(mcp_saga.ToolCallFailed):
        async with mcp_saga.workflow("order-gather", redis=ar, servers=clients) as wf:
            await asyncio.gather(*(wf.call(*call) for call in [FAILING_SHIPMENT, *ORDER[:2]]))
    *steps, failed = events(r)
    assert len(steps) == 2 and {e.type for e in steps} == {"step-completed"}
    assert failed.data.steps_completed == 2 and failed.data.failed_step.tool == "create_shipment"


async def test_an_overlay_from_the_config_is_what_the_event_records(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client], urls: dict[str, str]
) -> None:
    overlay = compensation("refund_payment", transactionId="$response.body#/transactionId", note="overlay")
    config = parse_config(
        {
            "prefix": "ov",
            "servers": {
                "payments": {"url": urls["payments"], "recovery": {"charge_payment": overlay}},
                "inventory": {"url": urls["inventory"]},
            },
        }
    )
    async with mcp_saga.workflow("order-ov", redis=ar, servers=clients, config=config) as wf:
        for call in ORDER[:2]:
            await wf.call(*call)
    reserve, charge, completed = events(r, Keys("ov"))
    assert charge.data.recovery == parse_recovery(overlay).to_wire() != DECLARED["charge_payment"]
    assert reserve.data.recovery == DECLARED["reserve_inventory"]  # no overlay: the server's declaration
    assert completed.type == "workflow-completed" and r.xlen(K.events) == 0


async def test_over_stdio_the_recovery_comes_from_the_live_listing(
    r: redis.Redis, ar: aioredis.Redis, tmp_path: Path
) -> None:
    params = stdio_params("mcp_saga.examples.payments", "--db", str(tmp_path / "p.db"))
    async with (
        Client(params) as payments,
        mcp_saga.workflow("order-stdio", redis=ar, servers={"payments": payments}) as wf,
    ):
        await wf.call(*ORDER[1], step="charge")
    step, _ = events(r)
    assert (step.data.step, step.data.recovery) == ("charge", DECLARED["charge_payment"])


async def test_sync_and_async_publishers_write_entries_the_coordinator_accepts(
    r: redis.Redis, ar: aioredis.Redis
) -> None:
    result = CallToolResult(content=[TextContent(type="text", text='{"id": "A-1"}')], structured_content={"id": "A-1"})
    recovery = parse_recovery(compensation("undo", id="$response.body#/id"))
    sync, async_ = mcp_saga.Publisher(r), mcp_saga.AsyncPublisher(ar)
    sync.step_completed("wf-sync", "a", "svc", "do", {"n": 1}, result, recovery, {"destructiveHint": False})
    await async_.step_completed("wf-async", "a", "svc", "do", {"n": 1}, {"structuredContent": {"id": "A-1"}}, recovery)
    sync.workflow_failed("wf-sync", "it broke", {"tool": "later", "error": "x" * 10_000}, steps_completed=1)
    await async_.workflow_failed("wf-async", "it broke", FailedStep(tool="later"), 1, parallel=True)
    entry_id = sync.workflow_completed("wf-done")
    assert isinstance(entry_id, str) and "-" in entry_id
    assert await async_.workflow_completed("wf-done-async")

    by_workflow = {}
    for event in events(r):
        by_workflow.setdefault(event.workflow, []).append(event.data)
    assert by_workflow["wf-sync"][0].result["structuredContent"] == {"id": "A-1"}
    assert by_workflow["wf-sync"][0].recovery == by_workflow["wf-async"][0].recovery == recovery.to_wire()
    assert len(by_workflow["wf-sync"][1].failed_step.error) == 8192  # clipped to the contract, not refused
    assert by_workflow["wf-done"] == [WorkflowCompleted()]
    unwind(r)
    for workflow in ("wf-sync", "wf-async"):
        assert r.hget(K.state(workflow), "status") == b"compensating"
        assert comp(r, workflow, "a")["arguments"] == {"id": "A-1"}
    assert r.hget(K.state("wf-done"), "status") == b"completed"


async def test_invalid_entries_are_refused_before_anything_is_written(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    sync, async_ = mcp_saga.Publisher(r), mcp_saga.AsyncPublisher(ar)
    result = {"structuredContent": {}}
    for bad in ["-leading-dash", "has space", "x" * 201, "{tag}", ""]:
        with pytest.raises(ValueError, match="invalid workflow id"):
            sync.workflow_completed(bad)
        with pytest.raises(ValueError, match="invalid workflow id"):
            await async_.step_completed(bad, "a", "svc", "do", {}, result)
        with pytest.raises(ValueError, match="invalid workflow id"):
            mcp_saga.workflow(bad, redis=ar, servers=clients)
    for bad in ["has space", "x" * 65, "", "a/b"]:
        with pytest.raises(ValueError, match="step"):
            sync.step_completed("wf", bad, "svc", "do", {}, result)
    with pytest.raises(ValueError, match=r"steps_completed|stepsCompleted"):
        sync.workflow_failed("wf", "r", steps_completed=-1)
    with pytest.raises(ValueError, match="not JSON"):
        sync.step_completed("wf", "a", "svc", "do", {"x": object()}, result)
    with pytest.raises(ValueError, match="not a URL"):
        mcp_saga.workflow("wf", redis=ar, servers={"http://127.0.0.1:1/mcp": clients["payments"]})
    with pytest.raises(TypeError, match=r"redis\.asyncio"):
        mcp_saga.workflow("wf", redis=r, servers=clients)
    async with mcp_saga.workflow("wf", redis=ar, servers=clients) as wf:
        with pytest.raises(ValueError, match="invalid step id"):
            await wf.call(*ORDER[1], step="no spaces please")
        with pytest.raises(ValueError, match="unknown server"):
            await wf.call("billing", "charge_payment", {})
    assert [e.type for e in events(r)] == ["workflow-completed"]  # only the clean exit; nothing else was written


async def test_a_result_over_the_cap_is_returned_whole_and_recorded_with_what_its_recovery_binds(
    r: redis.Redis, ar: aioredis.Redis
) -> None:
    """The text mirror goes first; then the result is cut to the recovery's pointers, with a marker."""
    app = MCPServer("big", log_level="WARNING")

    @recoverable_tool(app, compensation("forget", id="$response.body#/id"))
    def blob(size: int) -> dict[str, Any]:
        return {"id": f"B-{size}", "blob": "x" * size}

    @app.tool()
    def forget(id: str) -> str:
        return id

    async with Client(app) as client, mcp_saga.workflow("order-big", redis=ar, servers={"big": client}) as wf:
        await wf.call("big", "blob", {"size": 150_000})
        whole = await wf.call("big", "blob", {"size": 300_000})
    assert whole.structured_content["blob"] == "x" * 300_000  # the agent gets its result
    mirror, cut, done = events(r)
    assert mirror.data.result["structuredContent"]["blob"] == "x" * 150_000 and "content" not in mirror.data.result
    assert cut.data.result["structuredContent"] == {"id": "B-300000"}
    marker = cut.data.result["_meta"][CUT_META_KEY]
    assert marker["kept"] == ["$response.body#/id"] and marker["complete"] and marker["tool"] == "blob"
    assert marker["bytes"] > 600_000 and done.type == "workflow-completed"


async def test_a_step_that_could_not_be_written_refuses_the_next_call(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step's XADD fails every time (each of its retries): what a Redis gone for longer
    than they last looks like; every other write goes through."""
    xadd, writes = Pipelined.xadd, []

    async def first_step_lost(pipe: Pipelined, stream: str, fields: dict[bytes, bytes]) -> bytes:
        writes.append(fields)
        if b'"1-reserve_inventory"' in fields[b"data"]:
            raise redis.ConnectionError("redis went away")
        return await xadd(pipe, stream, fields)

    monkeypatch.setattr(Pipelined, "xadd", first_step_lost)
    monkeypatch.setattr(sdk, "Retry", lambda backoff, retries, **kw: Retry(NoBackoff(), 2, **kw))
    with pytest.raises(mcp_saga.StepNotRecorded, match="1-reserve_inventory"):
        async with mcp_saga.workflow("order-lost", redis=ar, servers=clients, intents=False) as wf:
            await wf.call(*ORDER[0])
            with pytest.raises(mcp_saga.StepNotRecorded):
                await wf.flush()
            await wf.call(*ORDER[1])  # refused before the tool runs: no new side effect on an unrecorded trail
    assert len(writes) == 3 + 1  # the step's write and its two retries, then the workflow-failed
    assert wf.steps_completed == 1
    (failed,) = events(r)
    assert failed.data.steps_completed == 1 and failed.data.reason.startswith("StepNotRecorded: ")


async def test_a_redis_restart_between_two_steps_loses_neither(clients: dict[str, Client], tmp_path: Path) -> None:
    """A real restart (SIGKILL, then the same port, the AOF kept): the shared event connection breaks,
    and the next step's XADD connects again under the retries instead of failing the call."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary, appendonly=True).start()
    try:
        client = aioredis.Redis.from_url(server.url)
        async with mcp_saga.workflow("order-restart", redis=client, servers=clients, intents=False) as wf:
            await wf.call(*ORDER[0])
            await wf.flush()
            server.stop(kill=True)
            restarted = asyncio.get_running_loop().run_in_executor(None, _restart_after, server, 0.3)
            await wf.call(*ORDER[1])  # its XADD meets a closed connection, then no server, then the new one
            await wf.flush()
            await restarted
        await client.aclose()
        sync = redis.Redis.from_url(server.url)
        found = [decode_entry(i.decode(), fields) for i, fields in sync.xrange(K.events)]
        sync.close()
        assert [e.type for e in found] == ["step-completed", "step-completed", "workflow-completed"]
        assert [e.data.step for e in found[:2]] == ["1-reserve_inventory", "2-charge_payment"]
    finally:
        server.cleanup()


@pytest.mark.timeout(60)  # each late reply was tried again: a stopped Redis held the call for two minutes
async def test_a_stopped_redis_refuses_the_call_instead_of_holding_it(clients: dict[str, Client]) -> None:
    """SIGSTOP, a Redis that accepts bytes and never answers: the intent's reply is REPLY_TIMEOUT late
    once, the call is not made, and the block's exit tries its failure signal once more."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary).start()
    assert server.process is not None
    before = await clients["payments"].call_tool("state", {})
    try:
        with pytest.raises(mcp_saga.StepNotRecorded, match="the call was not made"):
            async with mcp_saga.workflow("order-stalled", redis=server.url, servers=clients) as wf:
                await wf.call(*ORDER[0])
                server.process.send_signal(signal.SIGSTOP)
                await wf.call(*ORDER[1])
    finally:
        server.process.send_signal(signal.SIGCONT)
        server.cleanup()
    after = await clients["payments"].call_tool("state", {})
    assert len(after.structured_content["effects"]) == len(before.structured_content["effects"])


def _restart_after(server: RedisServer, delay: float) -> None:
    time.sleep(delay)
    server.start()


async def test_the_workflows_of_one_loop_share_one_event_connection(
    r: redis.Redis, redis_url: str, clients: dict[str, Client]
) -> None:
    """Each workflow's events go over the loop's one pipelined connection to that Redis, whether the
    workflow was given a client or the URL; redis-py's pool is not used for them."""
    given = aioredis.Redis.from_url(redis_url)
    pipes = []
    for n, target in enumerate([given, redis_url, given]):
        async with mcp_saga.workflow(f"order-shared-{n}", redis=target, servers=clients, intents=False) as wf:
            await wf.call(*ORDER[0])
            pipes.append(wf.publisher.pipe)
    assert pipes[0] is not None and pipes[0] is pipes[1] is pipes[2]
    assert pipes[0].connects == 1
    pool = given.connection_pool
    assert not pool._available_connections and not pool._in_use_connections  # type: ignore[attr-defined]
    await given.aclose()
    assert [e.type for e in events(r)] == ["step-completed", "workflow-completed"] * 3


async def test_a_tls_or_sentinel_redis_keeps_redis_py() -> None:
    """Where the pipelined connection cannot go, the workflow's events stay on redis-py's client."""
    settings = RedisSettings()
    assert await shared_pipelined(aioredis.Redis.from_url("rediss://127.0.0.1:1"), settings) is None
    assert await shared_pipelined("redis+sentinel://127.0.0.1:1/mymaster", settings) is None
    assert await shared_pipelined("rediss://127.0.0.1:1", settings) is None
    provided = aioredis.Redis(port=1, credential_provider=UsernamePasswordCredentialProvider("u", "p"))
    assert await shared_pipelined(provided, settings) is None
    cluster = RedisSettings(cluster=True, queue_url="redis://127.0.0.1:2")
    assert await shared_pipelined("redis://127.0.0.1:1", cluster) is None


async def test_each_call_is_announced_with_its_forward_key_which_the_server_receives(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client]
) -> None:
    async with mcp_saga.workflow("order-intent", redis=ar, servers=clients) as wf:
        result = await wf.call(*ORDER[1], step="charge")
    started, completed, done = events(r, intents=True)
    assert (started.type, completed.type, done.type) == ("step-started", "step-completed", "workflow-completed")
    key = forward_key("order-intent", "charge")
    assert (started.data.step, started.data.forward_key, started.data.arguments) == ("charge", key, ORDER[1][2])
    assert started.data.recovery == DECLARED["charge_payment"]  # the in-doubt plan needs the declaration
    state = await clients["payments"].call_tool("state", {})
    [effect] = [e for e in state.structured_content["effects"] if e["idempotencyKey"] == key]
    assert effect["holding"] == result.structured_content["transactionId"]


async def test_an_intent_redis_does_not_acknowledge_stops_the_call_before_it_is_made(
    r: redis.Redis, ar: aioredis.Redis, clients: dict[str, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("redis went away")

    monkeypatch.setattr(Pipelined, "xadd", refused)
    monkeypatch.setattr(sdk, "Retry", lambda backoff, retries, **kw: Retry(NoBackoff(), 1, **kw))
    before = await clients["payments"].call_tool("state", {})
    with pytest.raises(mcp_saga.StepNotRecorded, match="the call was not made"):
        async with mcp_saga.workflow("order-no-intent", redis=ar, servers=clients) as wf:
            await wf.call(*ORDER[1])
    after = await clients["payments"].call_tool("state", {})
    assert len(after.structured_content["effects"]) == len(before.structured_content["effects"])
