"""The gateway with real parts: example servers over HTTP, a coordinator, a worker and `saga gateway`.

Each scenario is the SEP's: reserve stock, charge the card, then the shipment fails; the app
signals the failure; and the servers' own ledgers must show the charge refunded and then the
reservation released (reverse order). Clients: the SDK's `Client` (the session as workflow, and
the header), PydanticAI, LangGraph, and the official TypeScript SDK from a Node script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import venv
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import mcp_types
import msgspec
import pytest
import redis
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp_saga.examples import SERVERS
from mcp_saga.examples.ledger import read_state
from mcp_saga.runtime.recovery_wire import RECOVERY_META_KEY, compensation, read_tool_declarations
from mcp_saga.runtime.sessions import GATEWAY_CLIENT, WORKER_CLIENT, SessionPool
from mcp_saga.schemas.config import load_config, parse_config, write_config
from mcp_saga.schemas.events import STEP_META_KEY, WORKFLOW_META_KEY, StepCompleted, decode_entry
from mcp_saga.schemas.keys import Keys
from processes import (
    REPO,
    free_port,
    saga_process,
    start_http_servers,
    stdio_params,
    stop,
    wait_for,
    wait_until_accepting,
)

K = Keys("gwt")
pytestmark = pytest.mark.anyio
TOKEN = "test-token-" + "x" * 16
DECLARED = {
    "reserve_inventory": compensation("release_inventory", reservationId="$response.body#/reservationId"),
    "charge_payment": compensation("refund_payment", transactionId="$response.body#/transactionId"),
    "create_shipment": compensation("cancel_shipment", shipmentId="$response.body#/shipmentId"),
}
# An operator overlay on shipping, so that tools/list shows the overlay winning over the server.
OVERLAY = compensation("cancel_shipment", shipmentId="$response.body#/shipmentId", note="overlay")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class World:
    r: redis.Redis
    gateway: str
    dbs: dict[str, Path]
    config: Path
    redis_url: str
    tmp: Path

    def url(self, server: str) -> str:
        return f"{self.gateway}/mcp/{server}"


@pytest.fixture(scope="module")
def world(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("gateway")
    dbs = {name: tmp / f"{name}.db" for name in SERVERS}
    client = redis.Redis.from_url(redis_url)
    client.flushdb()  # workflow ids are fixed per scenario: start from an empty stream
    specs = [(f"mcp_saga.examples.{name}", "--db", str(dbs[name])) for name in SERVERS]
    with start_http_servers(*specs) as started:
        urls = {name: url for name, (_, url) in zip(SERVERS, started, strict=True)}
        port = free_port()
        servers: dict[str, Any] = {name: {"url": url, "timeout": 10} for name, url in urls.items()}
        servers["shipping"]["recovery"] = {"create_shipment": OVERLAY}
        gateway = {"port": port, "tools": True, "token_env": "GW_TOKEN", "on_session_end": "fail"}
        settings = {"coordinator": {"block_ms": 50}, "worker": {"backoff_base": 0, "jitter": 0}, "gateway": gateway}
        config = write_config(parse_config({"prefix": "gwt", "servers": servers, **settings}), tmp / "saga.toml")
        env = {"GW_TOKEN": TOKEN}
        procs = [
            saga_process("coordinator", redis_url=redis_url, config=config, log=tmp / "coordinator.log"),
            saga_process("worker", redis_url=redis_url, config=config, log=tmp / "worker.log"),
            saga_process("gateway", redis_url=redis_url, config=config, env=env, log=tmp / "gateway.log"),
        ]
        try:
            wait_until_accepting("127.0.0.1", port, procs[2])
            yield World(client, f"http://127.0.0.1:{port}", dbs, config, redis_url, tmp)
        finally:
            for proc in procs:
                stop(proc)
            client.close()


@contextlib.asynccontextmanager
async def connect(url: str, headers: dict[str, str] | None = None, **kwargs: Any) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(url, http_client=http), **kwargs) as client,
    ):
        yield client


def steps_of(world: World, workflow: str, count: int = 0) -> list[StepCompleted]:
    """The workflow's completed steps as the coordinator recorded them (it trims saga:events once consumed);
    not the calls that answered with an error, whose intents the stack also holds (settled: nothing done)."""

    def read() -> list[StepCompleted]:
        stack = [msgspec.json.decode(raw) for raw in world.r.lrange(K.steps(workflow), 0, -1)]
        done = [msgspec.convert(e, StepCompleted) for e in stack if "result" in e]
        return [s for s in done if not s.result.get("isError")]

    wait_for(lambda: len(read()) >= count, timeout=30, what=f"{count} steps of {workflow}")
    return read()


def settled(world: World, workflow: str) -> str:
    def status() -> str | None:
        value = world.r.hget(K.state(workflow), "status")
        return value.decode() if value in (b"compensated", b"needs-attention", b"completed") else None

    return wait_for(status, timeout=60, what=f"{workflow} to settle")


def assert_undone_in_reverse(world: World, reservation: str, transaction: str) -> None:
    """The ledgers' own word: the charge refunded, then the reservation released."""
    payments = read_state(world.dbs["payments"])["effects"]
    inventory = read_state(world.dbs["inventory"])["effects"]
    refund = [e for e in payments if e["holding"] == transaction and e["change"] == "refunded"]
    release = [e for e in inventory if e["holding"] == reservation and e["change"] == "released"]
    assert len(refund) == 1 and len(release) == 1, (refund, release)
    assert refund[0]["at"] < release[0]["at"], "compensations ran in reverse completion order"


def comp(world: World, workflow: str) -> dict[str, dict[str, Any]]:
    return {k.decode(): msgspec.json.decode(v) for k, v in world.r.hgetall(K.comp(workflow)).items()}


# The SDK's own client, over the gateway.


async def test_tools_list_carries_recovery_and_the_overlay_wins(world: World) -> None:
    async with connect(world.url("shipping")) as client:
        declarations = await read_tool_declarations(client)
    shipment = declarations["create_shipment"]
    assert shipment.recovery == OVERLAY and shipment.recovery_source == "annotations"
    assert shipment.meta[RECOVERY_META_KEY] == OVERLAY and shipment.problem is None
    assert {"saga_fail", "saga_complete", "cancel_shipment"} <= set(declarations)
    async with connect(world.url("payments")) as client:
        declarations = await read_tool_declarations(client)
    assert declarations["charge_payment"].recovery == DECLARED["charge_payment"]
    assert declarations["charge_payment"].meta[RECOVERY_META_KEY] == DECLARED["charge_payment"]


async def test_without_a_token_nothing_is_reachable(world: World) -> None:
    async with httpx2.AsyncClient() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = await http.post(world.url("payments"), headers=headers, json={"jsonrpc": "2.0"})
            assert response.status_code == 401
        # A name outside the registry is no endpoint, whatever the client asks for.
        response = await http.post(f"{world.gateway}/mcp/stranger", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 404
    # An endpoint reaches only its own server: inventory's tool is unknown at /mcp/payments.
    before = read_state(world.dbs["inventory"])["effects"]
    async with connect(world.url("payments"), {"Saga-Workflow": "order-cross"}) as payments:
        crossed = await payments.call_tool("reserve_inventory", {"sku": "W-9", "quantity": 1})
    assert crossed.is_error and read_state(world.dbs["inventory"])["effects"] == before


async def test_session_is_the_workflow_and_its_end_fails_it(world: World) -> None:
    """A legacy (handshake) client sends no id: its session stands for the workflow; the policy fails it on close."""
    async with connect(world.url("payments"), mode="legacy") as client:
        result = await client.call_tool("charge_payment", {"orderId": "order-session", "amount": 12.5})
        again = await client.call_tool("state", {})
    workflow = result.meta[WORKFLOW_META_KEY]
    assert workflow.startswith("gw-") and again.meta[WORKFLOW_META_KEY] == workflow
    transaction = result.structured_content["transactionId"]
    assert settled(world, workflow) == "compensated"
    steps = steps_of(world, workflow)
    assert [s.tool for s in steps] == ["charge_payment", "state"]
    assert steps[0].arguments == {"orderId": "order-session", "amount": 12.5}
    assert steps[0].result["structuredContent"] == result.structured_content
    assert steps[0].step == result.meta[STEP_META_KEY]
    records = comp(world, workflow)
    assert records[steps[1].step]["status"] == "skipped"
    assert "no recovery in the event" in records[steps[1].step]["reason"]
    refunds = [e for e in read_state(world.dbs["payments"])["effects"] if e["holding"] == transaction]
    assert [e["change"] for e in refunds] == ["charged", "refunded"]


async def test_header_workflow_across_servers_failed_with_the_cli(world: World) -> None:
    workflow = "order-cli-1"
    headers = {"Saga-Workflow": workflow}
    async with connect(world.url("inventory"), headers) as inventory, connect(world.url("payments"), headers) as pay:
        reserved = await inventory.call_tool("reserve_inventory", {"sku": "W-1", "quantity": 2})
        charged = await pay.call_tool("charge_payment", {"orderId": workflow, "amount": 30})
        async with connect(world.url("shipping"), headers) as shipping:
            failed = await shipping.call_tool(
                "create_shipment", {"orderId": workflow, "address": "x", "simulateFailure": True}
            )
    assert failed.is_error and STEP_META_KEY not in (failed.meta or {})
    assert [s.tool for s in steps_of(world, workflow, 2)] == ["reserve_inventory", "charge_payment"]
    done = subprocess.run(
        ["saga", "fail", workflow, "--reason", "shipping refused", "--config", str(world.config)],
        env={**os.environ, "REDIS_URL": world.redis_url},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert settled(world, workflow) == "compensated"
    assert_undone_in_reverse(
        world, reserved.structured_content["reservationId"], charged.structured_content["transactionId"]
    )


async def test_meta_names_the_workflow_and_wins_over_the_header(world: World) -> None:
    async with connect(world.url("payments"), {"Saga-Workflow": "order-header"}) as client:
        result = await client.call_tool(
            "charge_payment", {"orderId": "m", "amount": 1}, meta={WORKFLOW_META_KEY: "order-meta"}
        )
        with pytest.raises(MCPError, match="invalid workflow id"):
            await client.call_tool(
                "charge_payment", {"orderId": "m", "amount": 1}, meta={WORKFLOW_META_KEY: "no spaces"}
            )
        done = await client.call_tool("saga_complete", {}, meta={WORKFLOW_META_KEY: "order-meta"})
    assert result.meta[WORKFLOW_META_KEY] == "order-meta" and not done.is_error
    assert settled(world, "order-meta") == "completed"
    assert [s.arguments for s in steps_of(world, "order-meta")] == [{"orderId": "m", "amount": 1}]
    assert steps_of(world, "order-header") == []  # the refused call reached nobody


# Real frameworks.


def _ship_failing(order: str) -> dict[str, Any]:
    return {"orderId": order, "address": "1 Main St", "simulateFailure": True}


async def test_pydantic_ai_agent_through_the_gateway(world: World) -> None:
    pytest.importorskip("pydantic_ai")
    from gateway_clients import run_pydantic_ai

    workflow = "order-pydantic-ai"
    outcome = await run_pydantic_ai(world.gateway, TOKEN, workflow)
    assert outcome["failed"], outcome
    assert settled(world, workflow) == "compensated"
    assert [s.tool for s in steps_of(world, workflow)] == ["reserve_inventory", "charge_payment"]
    assert_undone_in_reverse(world, outcome["reservationId"], outcome["transactionId"])


LANGGRAPH_VENV = REPO / ".cache" / "langgraph"


@pytest.fixture(scope="module")
def langgraph_python() -> Path:
    """langchain-mcp-adapters pins mcp<2, so LangGraph gets its own venv in .cache/ (gitignored), built once."""
    python = LANGGRAPH_VENV / "bin" / "python"
    if not (LANGGRAPH_VENV / ".ready").exists():
        venv.create(LANGGRAPH_VENV, with_pip=True, clear=True)
        packages = ["langchain-mcp-adapters>=0.3.2,<0.4", "langgraph>=1.2,<2", "langchain-core>=1.3,<2"]
        subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True, timeout=600)
        (LANGGRAPH_VENV / ".ready").touch()
    return python


def test_langgraph_agent_through_the_gateway(world: World, langgraph_python: Path) -> None:
    workflow = "order-langgraph"
    done = subprocess.run(
        [str(langgraph_python), str(REPO / "tests" / "gateway_langgraph.py"), world.gateway, workflow],
        env={**os.environ, "SAGA_GATEWAY_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["failed"], outcome
    assert settled(world, workflow) == "compensated"
    assert [s.tool for s in steps_of(world, workflow)] == ["reserve_inventory", "charge_payment"]
    assert_undone_in_reverse(world, outcome["reservationId"], outcome["transactionId"])


NODE_CLIENT = REPO / ".cache" / "ts-client"


@pytest.fixture(scope="module")
def ts_sdk() -> Path:
    """The official TypeScript SDK, installed once into .cache/ (gitignored); skipped only without npm."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm not installed")
    if not (NODE_CLIENT / "node_modules" / "@modelcontextprotocol" / "sdk").exists():
        NODE_CLIENT.mkdir(parents=True, exist_ok=True)
        (NODE_CLIENT / "package.json").write_text('{"name": "gateway-ts-client", "private": true}\n')
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--silent", "@modelcontextprotocol/sdk@1"],
            cwd=NODE_CLIENT,
            check=True,
            timeout=600,
        )
    return NODE_CLIENT


def test_typescript_sdk_client_through_the_gateway(world: World, ts_sdk: Path) -> None:
    workflow = "order-typescript"
    script = shutil.copy(REPO / "tests" / "gateway_client.mjs", ts_sdk)  # ESM resolves packages beside the script
    done = subprocess.run(
        ["node", str(script), world.gateway, workflow],
        cwd=ts_sdk,
        env={**os.environ, "SAGA_GATEWAY_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["recovery"] == DECLARED["charge_payment"]  # the raw tools/list, which listTools() strips
    assert outcome["shipmentFailed"] and outcome["failSignalled"]
    assert settled(world, workflow) == "compensated"
    assert [s.tool for s in steps_of(world, workflow)] == ["reserve_inventory", "charge_payment"]
    assert_undone_in_reverse(world, outcome["reservationId"], outcome["transactionId"])


async def test_concurrent_workflows_keep_their_own_steps_in_order(world: World) -> None:
    async def run(n: int) -> None:
        async with connect(world.url("payments"), {"Saga-Workflow": f"order-many-{n}"}) as client:
            for i in range(3):
                await client.call_tool("charge_payment", {"orderId": f"o{n}-{i}", "amount": i + 1})

    await asyncio.gather(*(run(n) for n in range(4)))
    for n in range(4):
        steps = steps_of(world, f"order-many-{n}", 3)
        assert [s.arguments["orderId"] for s in steps] == [f"o{n}-{i}" for i in range(3)]


def test_while_redis_is_down_new_calls_are_refused_before_they_reach_the_server(tmp_path: Path) -> None:
    """A Redis of its own, really killed: calls are refused (an MCP error) and the ledger shows no effect."""
    db = tmp_path / "payments.db"
    redis_port, gateway_port = free_port(), free_port()
    server = shutil.which("redis-server")
    assert server is not None
    command = [server, "--port", str(redis_port), "--save", "", "--appendonly", "no"]
    store = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{redis_port}/0"
    with start_http_servers(("mcp_saga.examples.payments", "--db", str(db))) as [(_, upstream)]:
        gateway_settings = {"port": gateway_port, "allow_anonymous": True, "publish_retry_for": 1}
        settings = {"servers": {"payments": {"url": upstream}}, "gateway": gateway_settings}
        config = write_config(parse_config(settings), tmp_path / "saga.toml")
        gateway = saga_process("gateway", redis_url=url, config=config, log=tmp_path / "gateway.log")
        try:
            wait_until_accepting("127.0.0.1", redis_port, store)
            wait_until_accepting("127.0.0.1", gateway_port, gateway)
            asyncio.run(_refused_while_down(f"http://127.0.0.1:{gateway_port}/mcp/payments", store, command, db))
        finally:
            stop(gateway)
            stop(store)


async def _refused_while_down(url: str, store: subprocess.Popen[bytes], command: list[str], db: Path) -> None:
    async with Client(url) as client:
        await client.call_tool("charge_payment", {"orderId": "before", "amount": 1}, meta={WORKFLOW_META_KEY: "wf-a"})
        store.kill()
        store.wait()

        async def refused() -> bool:
            try:
                await client.call_tool("state", {}, meta={WORKFLOW_META_KEY: "wf-probe"})
            except MCPError as exc:
                assert "Redis is unreachable" in str(exc) or "could not record" in str(exc)
                return True
            return False

        for _ in range(200):  # the gateway's health probe notices within about half a second
            if await refused():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("calls were still forwarded with Redis down")
        with pytest.raises(MCPError, match="Redis is unreachable"):
            await client.call_tool(
                "charge_payment", {"orderId": "while-down", "amount": 1}, meta={WORKFLOW_META_KEY: "wf-b"}
            )
        orders = [e["arguments"].get("orderId") for e in read_state(db)["effects"]]
        assert "before" in orders and "while-down" not in orders  # refused before forwarding: no charge

        revived = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            for _ in range(200):
                try:
                    await client.call_tool(
                        "charge_payment", {"orderId": "after", "amount": 1}, meta={WORKFLOW_META_KEY: "wf-c"}
                    )
                    break
                except MCPError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("calls stayed refused after Redis came back")
            steps = [
                decode_entry(i.decode(), f).data for i, f in redis.Redis(port=int(command[2])).xrange(Keys().events)
            ]
            charges = [s for s in steps if isinstance(s, StepCompleted) and s.tool == "charge_payment"]
            assert [s.arguments["orderId"] for s in charges] == ["after"]
        finally:
            stop(revived)


async def test_resources_prompts_and_progress_are_forwarded(tmp_path: Path, redis_url: str) -> None:
    """What the upstream offers besides tools reaches the client unchanged, and progress is relayed."""
    port = free_port()
    with start_http_servers(("tests.gateway_upstream",)) as [(_, upstream)]:
        settings = {"servers": {"extras": {"url": upstream}}, "gateway": {"port": port, "allow_anonymous": True}}
        config = write_config(parse_config({"prefix": "gwx", **settings}), tmp_path / "saga.toml")
        gateway = saga_process("gateway", redis_url=redis_url, config=config, log=tmp_path / "gateway.log")
        try:
            wait_until_accepting("127.0.0.1", port, gateway)
            async with Client(upstream) as direct, Client(f"http://127.0.0.1:{port}/mcp/extras") as through:
                for client in (direct, through):
                    resources = await client.list_resources()
                    assert [str(r.uri) for r in resources.resources] == ["note://hello"]
                    read = await client.read_resource("note://hello")
                    assert read.contents[0].text == "hello through the gateway"
                    prompts = await client.list_prompts()
                    assert [p.name for p in prompts.prompts] == ["greet"]
                    prompt = await client.get_prompt("greet", {"name": "Ada"})
                    assert "Say hello to Ada." in prompt.messages[0].content.text
                seen: list[tuple[float, float | None, str | None]] = []

                async def progress(value: float, total: float | None, message: str | None) -> None:
                    seen.append((value, total, message))

                result = await through.call_tool(
                    "count", {"to": 3}, progress_callback=progress, meta={WORKFLOW_META_KEY: "wf-progress"}
                )
            assert result.structured_content == {"counted": 3}
            assert seen == [(1, 3, "at 1"), (2, 3, "at 2"), (3, 3, "at 3")]
            await _list_changed_is_relayed(f"http://127.0.0.1:{port}/mcp/extras")
            await _cancellation_reaches_the_upstream(f"http://127.0.0.1:{port}/mcp/extras", tmp_path / "hold")
            # Who the upstream sees: the gateway and the workers introduce themselves by our names.
            async with Client(f"http://127.0.0.1:{port}/mcp/extras") as through:
                seen_as = await through.call_tool("whoami", {}, meta={WORKFLOW_META_KEY: "wf-who"})
            assert seen_as.structured_content["name"] == GATEWAY_CLIENT
            with SessionPool({"extras": load_config(config).servers["extras"]}) as pool:
                assert pool.call_tool("extras", "whoami")["structuredContent"]["name"] == WORKER_CLIENT
        finally:
            stop(gateway)


def test_the_pass_through_sends_upstream_only_what_mcp_defines(tmp_path: Path, redis_url: str) -> None:
    """The registry's credential goes upstream, never the client's token, cookies or our header and `_meta` key;
    bodies the gateway cannot read, foreign Host headers and a silent upstream get clear errors."""
    port = free_port()
    with start_http_servers(("tests.gateway_upstream",)) as [(_, upstream)]:
        servers = {
            "extras": {"url": upstream, "headers_from_env": {"Authorization": "GWT_UPSTREAM_KEY"}},
            "gone": {"url": f"http://127.0.0.1:{free_port()}/mcp", "timeout": 2},
        }
        settings = {"servers": servers, "gateway": {"port": port, "token_env": "GW_TOKEN"}}
        config = write_config(parse_config({"prefix": "gwh", **settings}), tmp_path / "saga.toml")
        env = {"GW_TOKEN": TOKEN, "GWT_UPSTREAM_KEY": "Bearer upstream-key"}
        gateway = saga_process("gateway", redis_url=redis_url, config=config, env=env, log=tmp_path / "gateway.log")
        try:
            wait_until_accepting("127.0.0.1", port, gateway)
            asyncio.run(_only_what_mcp_defines(f"http://127.0.0.1:{port}", upstream.split("/mcp")[0]))
        finally:
            stop(gateway)


async def _only_what_mcp_defines(base: str, upstream: str) -> None:
    headers = {"Saga-Workflow": "order-header", "Cookie": "session=secret"}
    async with connect(f"{base}/mcp/extras", headers) as client:
        result = await client.call_tool("seen", {}, meta={WORKFLOW_META_KEY: "order-seen", "note": "kept"})
    seen = result.structured_content
    assert seen is not None, result
    assert seen["headers"]["authorization"] == "Bearer upstream-key"
    assert not {"saga-workflow", "cookie"} & set(seen["headers"])
    assert seen["headers"]["host"] == upstream.removeprefix("http://")
    assert seen["meta"]["note"] == "kept" and WORKFLOW_META_KEY not in seen["meta"]
    assert result.meta[WORKFLOW_META_KEY] == "order-seen"
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "seen", "arguments": {}}}
    sent = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient(headers=sent) as http:
        garbled = await http.post(
            f"{base}/mcp/extras", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert garbled.status_code == 400 and garbled.json()["error"]["code"] == -32700
        batch = await http.post(f"{base}/mcp/extras", json=[call])
        assert batch.status_code == 400 and "batch" in batch.json()["error"]["message"]
        foreign = await http.post(f"{base}/mcp/extras", json=call, headers={"Host": "evil.example"})
        assert foreign.status_code in (400, 421)  # DNS rebinding protection on a loopback gateway
        named = {**call, "params": {**call["params"], "_meta": {WORKFLOW_META_KEY: "order-gone"}}}
        silent = await http.post(f"{base}/mcp/gone", json=named)
        assert silent.status_code == 200 and "did not answer" in silent.json()["error"]["message"]


async def _cancellation_reaches_the_upstream(url: str, marker: Path) -> None:
    async with Client(url) as client:
        call = asyncio.ensure_future(
            client.call_tool("hold", {"marker": str(marker)}, meta={WORKFLOW_META_KEY: "wf-c"})
        )
        started, cancelled = Path(f"{marker}.started"), Path(f"{marker}.cancelled")
        for _ in range(400):
            if started.exists():
                break
            await asyncio.sleep(0.025)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
    for _ in range(400):  # the client's cancel reaches the gateway, whose abandoned upstream call is cancelled
        if cancelled.exists():
            return
        await asyncio.sleep(0.025)
    raise AssertionError("the upstream tool was never cancelled")


async def _list_changed_is_relayed(url: str) -> None:
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, mcp_types.ToolListChangedNotification):
            changed.set()

    async with Client(url, mode="legacy", message_handler=on_message) as client:
        assert "grown" not in {tool.name for tool in (await client.list_tools()).tools}
        await client.call_tool("grow", {}, meta={WORKFLOW_META_KEY: "wf-grow"})
        await asyncio.wait_for(changed.wait(), 10)
        assert "grown" in {tool.name for tool in (await client.list_tools()).tools}


def test_stdio_gateway_is_one_session_and_its_end_applies_the_policy(world: World, tmp_path: Path) -> None:
    """`saga gateway --stdio payments`, spawned by the client as a host spawns a server."""
    base = load_config(world.config)
    config = write_config(
        base.model_copy(update={"gateway": base.gateway.model_copy(update={"tools": False})}), tmp_path / "saga.toml"
    )

    async def run() -> tuple[str, str]:
        env = {"REDIS_URL": world.redis_url, "SAGA_CONFIG": str(config), "SAGA_LOG": "text"}
        params = stdio_params("mcp_saga.cli", "gateway", "--stdio", "payments", env={**os.environ, **env})
        async with Client(params) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            assert "charge_payment" in names and "saga_fail" not in names  # lifecycle tools off here
            charged = await client.call_tool("charge_payment", {"orderId": "stdio", "amount": 4})
        return charged.meta[WORKFLOW_META_KEY], charged.structured_content["transactionId"]

    workflow, transaction = asyncio.run(run())
    assert workflow.startswith("gw-")
    assert settled(world, workflow) == "compensated"  # on_session_end = "fail" in this config
    changes = [e["change"] for e in read_state(world.dbs["payments"])["effects"] if e["holding"] == transaction]
    assert changes == ["charged", "refunded"]


async def test_pagination_cursors_pass_through(tmp_path: Path, redis_url: str) -> None:
    port = free_port()
    with start_http_servers(("tests.gateway_paged",)) as [(_, upstream)]:
        settings = {"servers": {"paged": {"url": upstream}}, "gateway": {"port": port, "allow_anonymous": True}}
        config = write_config(parse_config({"prefix": "gwp", **settings}), tmp_path / "saga.toml")
        gateway = saga_process("gateway", redis_url=redis_url, config=config, log=tmp_path / "gateway.log")
        try:
            wait_until_accepting("127.0.0.1", port, gateway)
            async with Client(f"http://127.0.0.1:{port}/mcp/paged") as client:
                pages, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    pages.append([tool.name for tool in page.tools])
                    cursor = page.next_cursor
                    if not cursor:
                        break
            assert pages == [["tool_0", "tool_1"], ["tool_2", "tool_3"], ["tool_4"]]
        finally:
            stop(gateway)
