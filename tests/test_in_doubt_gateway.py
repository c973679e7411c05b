"""In-doubt steps through `saga gateway`, checked from outside: a real redis-server, the example
servers over HTTP, coordinator and worker processes, and the gateway over HTTP and `--stdio`.

- the upstream commits the effect and dies (the connection drops): the intent the gateway wrote
  before forwarding carries the key the server stored with the effect; after the agent's
  `saga_fail`, the idempotent tool is called again with that key and its reservation released;
- the gateway itself is SIGKILLed mid-call: nothing is left to apply `on_session_end`, and the
  coordinator's `in_doubt_after` fails the workflow and unwinds it;
- with `[redis] wait_replicas` and no replica to confirm, the intent is not acknowledged, so the
  call is refused before it reaches the server (as the SDK's is).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import msgspec
import pytest
import redis
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_saga.examples.ledger import read_state
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.keys import Keys
from processes import REPO, free_port, saga_process, stop_all, wait_for, wait_until_accepting
from test_in_doubt import holdings, serve, settled

K = Keys()
TOKEN = "in-doubt-" + "t" * 24
COORDINATOR = {"block_ms": 100, "in_doubt_after": 2, "watchdog_every": 0.2}
WORKFLOW_META = "io.github.mcp-saga/workflow"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_all(*started)


def config_for(tmp: Path, url: str, gateway_port: int, in_doubt_after: float = 2, **redis_settings: Any) -> Path:
    """`in_doubt_after` fails a silent workflow with a call open: short where a test waits for it."""
    servers = {"inventory": {"url": url, "timeout": 5, "idempotent": ["reserve_inventory"]}}
    gateway = {"port": gateway_port, "tools": True, "token_env": "GW_TOKEN", "on_session_end": "fail"}
    coordinator = {**COORDINATOR, "in_doubt_after": in_doubt_after}
    sections = {"coordinator": coordinator, "worker": {"backoff_base": 0, "jitter": 0}, "gateway": gateway}
    if redis_settings:
        sections["redis"] = redis_settings
    return write_config(parse_config({"servers": servers, **sections}), tmp / "saga.toml")


def http_gateway(procs: list, redis_url: str, config: Path, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    gateway = saga_process("gateway", redis_url=redis_url, config=config, env={"GW_TOKEN": TOKEN}, log=tmp / "gw.log")
    procs.append(gateway)
    wait_until_accepting("127.0.0.1", port, gateway)
    return gateway


@contextlib.asynccontextmanager
async def through_http(port: int, workflow: str) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Saga-Workflow": workflow}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,  # an unconfirmed intent is re-sent for 5 s
        Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp/inventory", http_client=http)) as client,
    ):
        yield client


def through_stdio(redis_url: str, config: Path) -> Client:
    env = {**os.environ, "REDIS_URL": redis_url, "SAGA_CONFIG": str(config), "SAGA_LOG": "text"}
    command = [sys.executable, "-m", "mcp_saga.cli", "gateway", "--stdio", "inventory"]
    return Client(StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=str(REPO)))


def forward_keys(r: redis.Redis, workflow: str) -> list[str]:
    """The forward keys the coordinator holds for the workflow's steps, from the intents it recorded."""
    records = [msgspec.json.decode(raw) for raw in r.hvals(K.comp(workflow))]
    return [c["forwardKey"] for c in records if c.get("forwardKey")]


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_an_upstream_that_commits_then_drops_is_recalled_with_the_forward_key_and_undone(
    transport: str, r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    port, db, gateway_port = free_port("127.0.0.1"), tmp_path / "inventory.db", free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    upstream = serve("mcp_saga.examples.inventory", port, db, "example.after-commit=kill")
    # The agent signals the failure itself, after the upstream's restart (seconds on a loaded box):
    # the coordinator must not fail the workflow first and recall into the restart.
    config = config_for(tmp_path, url, gateway_port, in_doubt_after=60)
    workflow = f"gw-drop-{transport}"
    for part in ("coordinator", "worker"):
        procs.append(saga_process(part, redis_url=redis_url, config=config, log=tmp_path / f"{part}.log"))
    if transport == "http":
        http_gateway(procs, redis_url, config, gateway_port, tmp_path)

    async def agent() -> None:
        client = through_http(gateway_port, workflow) if transport == "http" else through_stdio(redis_url, config)
        meta = {WORKFLOW_META: workflow}
        async with client as inventory:
            await inventory.list_tools()
            with pytest.raises(MCPError):  # the gateway's word that the upstream did not answer
                await inventory.call_tool("reserve_inventory", {"sku": "A", "quantity": 2}, meta=meta)
            assert upstream.wait(10) == -signal.SIGKILL
            procs.append(serve("mcp_saga.examples.inventory", port, db))  # back, without the fault
            await inventory.call_tool("saga_fail", {"reason": "the reservation did not answer"}, meta=meta)

    anyio.run(agent)
    state = settled(r, workflow)
    assert state["status"] == "compensated", state
    [key] = forward_keys(r, workflow)
    reserve, release = read_state(db)["effects"]  # one reservation: the recall returned the first result
    assert (reserve["tool"], reserve["idempotencyKey"]) == ("reserve_inventory", key)
    assert release["tool"] == "release_inventory"
    [held] = holdings(db, "reservation")
    assert held["status"] == "released"


def test_a_gateway_killed_mid_call_leaves_the_workflow_to_the_coordinators_in_doubt_deadline(
    r: redis.Redis, redis_url: str, tmp_path: Path, procs: list
) -> None:
    port, db, gateway_port = free_port("127.0.0.1"), tmp_path / "inventory.db", free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.inventory", port, db, "example.after-commit=sleep(30000)"))
    config = config_for(tmp_path, url, gateway_port)
    for part in ("coordinator", "worker"):
        procs.append(saga_process(part, redis_url=redis_url, config=config, log=tmp_path / f"{part}.log"))
    gateway = http_gateway(procs, redis_url, config, gateway_port, tmp_path)

    async def agent() -> None:
        async with through_http(gateway_port, "gw-killed") as inventory, anyio.create_task_group() as calls:
            calls.start_soon(inventory.call_tool, "reserve_inventory", {"sku": "A", "quantity": 2})
            await anyio.to_thread.run_sync(lambda: wait_for(lambda: holdings(db, "reservation"), timeout=20))
            gateway.send_signal(signal.SIGKILL)
            calls.cancel_scope.cancel()

    with contextlib.suppress(Exception):  # the client's transport fails with the gateway
        anyio.run(agent)
    assert gateway.wait(10) == -signal.SIGKILL
    state = settled(r, "gw-killed")
    assert state["status"] == "compensated", state
    assert "presumed gone" in state["reason"]
    [held] = holdings(db, "reservation")
    assert held["status"] == "released"


def test_an_intent_too_few_replicas_confirmed_refuses_the_call_before_it_is_forwarded(
    redis_url: str, tmp_path: Path, procs: list
) -> None:
    """`[redis] wait_replicas = 1` against a Redis with no replica: no write is ever confirmed."""
    port, db, gateway_port = free_port("127.0.0.1"), tmp_path / "inventory.db", free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    procs.append(serve("mcp_saga.examples.inventory", port, db))
    config = config_for(tmp_path, url, gateway_port, wait_replicas=1, wait_timeout_ms=20)
    http_gateway(procs, redis_url, config, gateway_port, tmp_path)

    async def agent() -> None:
        async with through_http(gateway_port, "gw-unreplicated") as inventory:
            with pytest.raises(MCPError, match="could not record the intent"):
                await inventory.call_tool("reserve_inventory", {"sku": "A", "quantity": 2})

    anyio.run(agent)
    assert holdings(db, "reservation") == []  # the call never reached the server


def test_a_client_key_the_intent_cannot_carry_refuses_the_call_with_the_reason(
    redis_url: str, tmp_path: Path, procs: list
) -> None:
    """The client's own idempotency key becomes the forward key; one over the contract's 200 characters
    cannot be recorded, so the call is refused before it is forwarded, saying why (not a bare 500)."""
    port, db, gateway_port = free_port("127.0.0.1"), tmp_path / "inventory.db", free_port()
    procs.append(serve("mcp_saga.examples.inventory", port, db))
    http_gateway(
        procs, redis_url, config_for(tmp_path, f"http://127.0.0.1:{port}/mcp", gateway_port), gateway_port, tmp_path
    )

    async def agent() -> None:
        async with through_http(gateway_port, "gw-long-key") as inventory:
            meta = {"io.github.mcp-saga/idempotency-key": "k" * 300}
            with pytest.raises(MCPError, match=r"could not record the intent.*forwardKey.*not forwarded"):
                await inventory.call_tool("reserve_inventory", {"sku": "A", "quantity": 2}, meta=meta)

    anyio.run(agent)
    assert holdings(db, "reservation") == []
