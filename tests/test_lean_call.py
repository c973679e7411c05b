"""The worker's lean `tools/call` (runtime/lean_call.py) against real MCP server processes over HTTP.

Each server is called both ways on one warm session of a SessionPool: on the lean channel, and
through the MCP SDK's `Client` (the channel switched off), and the two must agree on what the
server saw (headers, `_meta`) and on what the caller gets (results, errors). Servers: a Python
SDK server answering SSE streams or plain JSON (2026-07-28, no session), and a TypeScript SDK
1.x server with sessions (the 2025-11-25 handshake).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp_saga.runtime.sessions import CallTimeout, ProtocolError, SessionPool, TransportError
from mcp_saga.schemas.config import ServerConfig
from processes import REPO, free_port, stop, wait_for, wait_until_accepting
from test_gateway import ts_sdk  # noqa: F401 - the fixture: the TypeScript SDK installed once into .cache/

SERVER = """
import asyncio, json, os, sys
from mcp import MCPError
from mcp.server.mcpserver import Context, MCPServer
from pydantic import BaseModel

app = MCPServer("lean", log_level="WARNING")

class Out(BaseModel):
    n: int

@app.tool()
def seen(ctx: Context) -> str:
    context = ctx.request_context
    return json.dumps({"headers": dict(context.request.headers), "meta": context.meta}, default=str)

@app.tool()
def echo(n: int) -> Out:
    return Out(n=n)

@app.tool()
def fails() -> str:
    raise ValueError("no luck today")

@app.tool()
def refuses() -> str:
    raise MCPError(-32602, "not with these arguments")

@app.tool()
async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"

@app.tool()
def die() -> str:
    os._exit(3)

@app.tool()
async def dies_midway(ctx: Context) -> str:
    await ctx.info("half way")  # on the call's SSE stream: the answer has begun
    await asyncio.sleep(0.2)
    os._exit(3)

app.run("streamable-http", port=int(sys.argv[1]), json_response=sys.argv[2] == "json")
"""
# Set by the HTTP client itself, not by the MCP layer: they differ between httpx2 and the lean client.
TRANSPORT_HEADERS = {"host", "user-agent", "accept-encoding", "connection", "content-length"}


def _python_server(answers: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), answers], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        wait_until_accepting("127.0.0.1", port, proc)
        yield proc, f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


@pytest.fixture(params=["sse", "json"])
def python_server(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    yield from _python_server(request.param)


@pytest.fixture
def ts_server(ts_sdk: Path) -> Iterator[str]:  # noqa: F811 - the imported fixture
    script = shutil.copy(REPO / "tests" / "lean_server.mjs", ts_sdk)  # ESM resolves packages beside the script
    port = free_port()
    proc = subprocess.Popen(["node", str(script), str(port)], cwd=ts_sdk, stderr=subprocess.DEVNULL)
    try:
        wait_until_accepting("127.0.0.1", port, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


def _lean(pool: SessionPool, server: str, on: bool) -> None:
    channel = pool._sessions.owner(server).lean
    assert channel is not None
    channel.usable = on


def _sent(pool: SessionPool, server: str) -> int:
    channel = pool._sessions.owner(server).lean
    return channel.sent if channel is not None else 0


def _seen(pool: SessionPool, server: str) -> dict[str, Any]:
    meta = {"idempotencyKey": "k-1", "traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
    result = pool.call_tool(server, "seen", {}, meta)
    seen = json.loads(result["content"][0]["text"])
    seen["headers"] = {k.lower(): v for k, v in seen["headers"].items() if k.lower() not in TRANSPORT_HEADERS}
    return seen


def _both_ways(pool: SessionPool, server: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the server saw of the same call sent lean and through the SDK, on one session."""
    lean_before = _sent(pool, server)
    lean = _seen(pool, server)
    assert _sent(pool, server) == lean_before + 1
    _lean(pool, server, False)
    sdk = _seen(pool, server)
    _lean(pool, server, True)
    assert _sent(pool, server) == lean_before + 1
    return lean, sdk


def test_the_lean_call_sends_what_the_sdk_sends_and_returns_what_it_returns(
    python_server: tuple[subprocess.Popen[bytes], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAGA_TEST_TOKEN", "Bearer s3cret")
    _, url = python_server
    config = ServerConfig(url=url, headers_from_env={"Authorization": "SAGA_TEST_TOKEN"}, timeout=10)
    with SessionPool({"py": config}) as pool:
        lean, sdk = _both_ways(pool, "py")
        assert lean == sdk
        assert lean["headers"]["authorization"] == "Bearer s3cret"
        assert lean["headers"]["mcp-method"] == "tools/call" and lean["headers"]["mcp-name"] == "seen"
        assert lean["meta"]["idempotencyKey"] == "k-1" and lean["meta"]["traceparent"].startswith("00-1111")

        before = _sent(pool, "py")
        results = [pool.call_tool("py", "echo", {"n": n}) for n in range(3)]
        assert _sent(pool, "py") == before + 3
        _lean(pool, "py", False)
        assert [pool.call_tool("py", "echo", {"n": n}) for n in range(3)] == results
        assert results[1]["structuredContent"] == {"n": 1} and results[1]["isError"] is False
        failed_sdk = pool.call_tool("py", "fails")
        _lean(pool, "py", True)
        failed = pool.call_tool("py", "fails")  # an error result is a result
        assert failed == failed_sdk and failed["isError"] is True and "fails" in failed["content"][0]["text"]
        assert pool.connects("py") == 1


def test_protocol_errors_are_the_sdks(python_server: tuple[subprocess.Popen[bytes], str]) -> None:
    _, url = python_server
    with SessionPool({"py": ServerConfig(url=url, timeout=10)}) as pool:
        pool.call_tool("py", "echo", {"n": 1})
        errors = []
        for on in (True, False):
            _lean(pool, "py", on)
            with pytest.raises(ProtocolError) as caught:
                pool.call_tool("py", "refuses")
            errors.append((caught.value.code, str(caught.value), caught.value.retryable))
        assert errors[0] == errors[1] == (-32602, "MCP error -32602: not with these arguments", False)
        assert pool.connects("py") == 1


def test_a_server_that_never_answers_the_call_is_a_timeout_and_the_session_stays(
    python_server: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, url = python_server
    with SessionPool({"py": ServerConfig(url=url, timeout=10)}) as pool:
        pool.call_tool("py", "echo", {"n": 1})
        with pytest.raises(CallTimeout) as caught:
            pool.call_tool("py", "slow", {"seconds": 30}, timeout=0.5)
        assert caught.value.retryable
        assert pool.call_tool("py", "slow", {"seconds": 0})["structuredContent"] == {"result": "done"}
        assert pool.connects("py") == 1 and _sent(pool, "py") == 3


def test_a_server_that_drops_the_connection_mid_call_is_a_transport_error() -> None:
    for proc, url in _python_server("sse"):
        with SessionPool({"py": ServerConfig(url=url, timeout=5)}) as pool:
            pool.call_tool("py", "echo", {"n": 1})
            with pytest.raises(TransportError) as caught:
                pool.call_tool("py", "die")
            assert caught.value.retryable and "closed the connection" in str(caught.value)
            assert _sent(pool, "py") == 2
            assert proc.wait(5) == 3  # the call did reach the server, which went away under it


def test_the_call_is_made_by_the_calling_thread_not_on_the_sessions_loop(
    python_server: tuple[subprocess.Popen[bytes], str],
) -> None:
    """Once the session is up, a call goes out from the caller's thread on a connection of its own: it is
    answered, and times out, while the sessions' loop is held up (as the hand-over to it and back is gone)."""
    _, url = python_server
    with SessionPool({"py": ServerConfig(url=url, timeout=10)}) as pool:
        pool.call_tool("py", "echo", {"n": 1})  # connects on the loop; the tool's output schema is listed there
        owner = pool._sessions.owner("py")
        assert owner.live is not None and "echo" in owner.live.session._tool_output_schemas
        held, release = threading.Event(), threading.Event()
        assert pool._loop is not None
        pool._loop.call_soon_threadsafe(lambda: (held.set(), release.wait(30)))
        assert held.wait(5)
        try:
            assert pool.call_tool("py", "echo", {"n": 2}, timeout=2)["structuredContent"] == {"n": 2}
            with pytest.raises(CallTimeout, match=r"no answer within 0\.5 s") as caught:
                pool.call_tool("py", "slow", {"seconds": 30}, timeout=0.5)
            assert caught.value.retryable
            with pytest.raises(ProtocolError, match="not with these arguments"):
                pool.call_tool("py", "refuses", timeout=2)
        finally:
            release.set()
        assert pool.call_tool("py", "slow", {"seconds": 0})["structuredContent"] == {"result": "done"}
        assert owner.lean is not None and owner.lean.direct == 4
        assert pool.connects("py") == 1


def test_rqs_job_timeout_stops_a_call_the_slot_thread_makes_itself(
    python_server: tuple[subprocess.Popen[bytes], str],
) -> None:
    """A slot thread's job timeout (workers/watchdog.py) is an exception raised in that thread from outside: it
    must land in the thread's own blocking read, which waits a second at a time, long before the call's timeout."""
    from mcp_saga.workers.watchdog import WatchdogDeathPenalty
    from rq.timeouts import JobTimeoutException

    _, url = python_server
    with SessionPool({"py": ServerConfig(url=url, timeout=120)}) as pool:
        pool.call_tool("py", "echo", {"n": 1})
        caught: list[BaseException] = []

        def job() -> None:
            try:
                with WatchdogDeathPenalty(1, JobTimeoutException, job_id="slow"):
                    pool.call_tool("py", "slow", {"seconds": 60})
            except BaseException as exc:  # what RQ's perform_job sees
                caught.append(exc)

        slot = threading.Thread(target=job)
        slot.start()
        slot.join(30)  # well inside the call's 120 s timeout
        assert not slot.is_alive()
        assert len(caught) == 1 and isinstance(caught[0], JobTimeoutException)
        assert str(caught[0]) == "Task exceeded maximum timeout value (1 seconds)"
        assert pool.call_tool("py", "echo", {"n": 2})["structuredContent"] == {"n": 2}
        assert pool.connects("py") == 1


def test_a_server_that_drops_the_connection_mid_answer_fails_the_call_and_drops_the_session() -> None:
    for proc, url in _python_server("sse"):
        with SessionPool({"py": ServerConfig(url=url, timeout=5)}) as pool:
            pool.call_tool("py", "echo", {"n": 1})
            owner = pool._sessions.owner("py")
            assert owner.lean is not None
            direct = owner.lean.direct
            with pytest.raises(TransportError, match="closed the connection before its answer ended") as caught:
                pool.call_tool("py", "dies_midway")
            assert caught.value.retryable and owner.lean.direct == direct + 1
            assert owner.live is None  # dropped, as a call on the loop that broke drops it: the next one reconnects
            assert proc.wait(5) == 3


def test_an_old_protocol_server_with_sessions(ts_server: str) -> None:
    with SessionPool({"ts": ServerConfig(url=ts_server, timeout=10)}) as pool:
        # The first call may go through the SDK: nothing is sent before `notifications/initialized` was answered.
        assert pool.call_tool("ts", "echo", {"n": 6})["content"][0]["text"] == "6"
        lean, sdk = _both_ways(pool, "ts")
        assert lean == sdk
        assert lean["headers"]["mcp-protocol-version"] == "2025-11-25"
        assert lean["headers"]["mcp-session-id"]  # the server refuses a request without its session
        assert lean["meta"]["idempotencyKey"] == "k-1"
        assert pool.call_tool("ts", "echo", {"n": 7})["content"][0]["text"] == "7"
        # A server that asks the client mid-call gets the SDK's answers (it has no handlers), then the SDK serves it.
        _lean(pool, "ts", False)
        asked_sdk = pool.call_tool("ts", "asks")
        _lean(pool, "ts", True)
        sent = _sent(pool, "ts")
        assert pool.call_tool("ts", "asks") == asked_sdk
        assert asked_sdk["content"][0]["text"] == "pinged; refused: -32600 MCP error -32600: Sampling not supported"
        assert _sent(pool, "ts") == sent + 1 and not pool._sessions.owner("ts").lean.usable
        pool.call_tool("ts", "echo", {"n": 7})
        assert _sent(pool, "ts") == sent + 1
        _lean(pool, "ts", True)
        # The server forgets its sessions (as a restarted one would): 404, a reconnect, a new session.
        pool.call_tool("ts", "forget")
        with pytest.raises(TransportError, match="Session terminated"):
            pool.call_tool("ts", "echo", {"n": 8})
        assert pool.call_tool("ts", "echo", {"n": 9})["content"][0]["text"] == "9"
        assert (
            pool.connects("ts") == 2
            and _seen(pool, "ts")["headers"]["mcp-session-id"] != lean["headers"]["mcp-session-id"]
        )


def test_the_private_sdk_names_the_lean_call_relies_on() -> None:
    """mcp is pinned <3 and the lean call reads the live session's stamp and validators: an SDK release that
    renames them must fail here, not in a worker."""
    from mcp import Client
    from mcp.client import session as sdk_session
    from mcp.client.session import ClientSession

    assert callable(sdk_session._clamp_inbound_ttl) and callable(sdk_session._later_revision_fields)
    for name in ("_relist_tool", "_drive_input_required"):
        assert callable(getattr(Client, name, None)), name
    assert callable(getattr(ClientSession, "validate_tool_result", None))
    source = Path(sdk_session.__file__).read_text()
    names = (
        "self._stamp(data, opts)",
        "self._call_tool_adapter",
        "self._negotiated_version",
        "self._tool_output_schemas",
    )
    for name in names:
        assert name in source, name


DROPPER = """
import os, sys
from mcp.server.mcpserver import MCPServer
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool

app = MCPServer("dropper", log_level="WARNING")
log, marker = sys.argv[2], sys.argv[2] + ".dropped"

@recoverable_tool(app, compensation("give_back", n="$request.body#/n"))
def take(n: int) -> int:
    return n

@app.tool()
def give_back(n: int, idempotencyKey: str | None = None) -> str:
    with open(log, "a") as out:
        out.write(f"{idempotencyKey}\\n")
    if not os.path.exists(marker):  # the first attempt: the process, and its connection, go away mid-call
        open(marker, "w").close()
        os._exit(3)
    return "given back"

app.run("streamable-http", port=int(sys.argv[1]))
"""


def test_a_worker_whose_server_drops_the_call_retries_it_with_the_same_idempotency_key(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from test_worker_job import FAST, plan, reports, start_worker, write_config

    port, log = free_port(), tmp_path / "give_back.log"
    command = [sys.executable, "-c", DROPPER, str(port), str(log)]
    server = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
    settings = {**FAST, "backoff_base": 1, "backoff_max": 1}
    config = write_config(tmp_path / "saga.toml", {"d": {"url": f"http://127.0.0.1:{port}/mcp"}}, worker=settings)
    worker = start_worker(redis_url, config, "w-dropped", tmp_path / "worker.log")
    try:
        wait_until_accepting("127.0.0.1", port, server)
        job = plan(r, "order-drop", "take", {"n": 4}, server="d", tool="take", operation="give_back", worker=settings)
        wait_for(lambda: reports(r, "order-drop"), what="the first report")
        kind, first = reports(r, "order-drop")[0]
        assert kind == "compensation-failed" and first.retryable and not first.final
        assert "closed the connection before its answer ended" in first.error  # the lean call's own words
        assert server.wait(10) == 3
        server = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
        wait_until_accepting("127.0.0.1", port, server)
        wait_for(lambda: reports(r, "order-drop")[-1][0] == "compensation-succeeded", what="success after restart")
    finally:
        stop(worker)
        stop(server)
    assert log.read_text().split() == [job.idempotency_key] * 2
