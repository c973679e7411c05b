"""SessionPool against real MCP server processes, over stdio and streamable HTTP.

`SCRATCH` is a tiny server (run with `python -c`) with the misbehaviours the example servers do
not have: a tool that hangs, one that kills its own process, and a gate that holds a call until
the test opens it (the lease test in test_worker_job uses it).
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import redis
from mcp_saga.runtime.sessions import CallTimeout, SessionPool, TransportError, UnknownServer
from mcp_saga.schemas.config import ServerConfig
from processes import REPO, free_port, start_http_server, stop, wait_until_accepting

SCRATCH = """
import asyncio, os, sys
from mcp.server.mcpserver import MCPServer
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool

app = MCPServer("scratch", log_level="WARNING")

@app.tool()
async def slow(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"

@app.tool()
def die() -> str:
    os._exit(3)

@app.tool()
def pid() -> int:
    return os.getpid()

@recoverable_tool(app, compensation("release", gate="$request.body#/gate"))
def grab(gate: str) -> str:
    return gate

@app.tool()
async def release(gate: str, idempotencyKey: str | None = None) -> str:
    with open(gate + ".log", "a") as log:
        log.write(f"enter {idempotencyKey}\\n")
    while not os.path.exists(gate):
        await asyncio.sleep(0.02)
    return "released"

if len(sys.argv) > 1:
    app.run("streamable-http", port=int(sys.argv[1]))
else:
    app.run()
"""


def scratch_stdio(**settings: object) -> ServerConfig:
    return ServerConfig(command=[sys.executable, "-c", SCRATCH], cwd=str(REPO), **settings)  # type: ignore[arg-type]


@pytest.fixture
def scratch_http() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SCRATCH, str(port)], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        wait_until_accepting("127.0.0.1", port, proc)
        yield proc, f"http://127.0.0.1:{port}/mcp"
    finally:
        stop(proc)


@pytest.fixture
def trivial_http() -> Iterator[str]:
    with start_http_server("mcp_saga.examples.trivial") as (_, url):
        yield url


def test_one_warm_session_per_server_over_stdio_and_http(trivial_http: str) -> None:
    servers = {
        "stdio": ServerConfig(command=[sys.executable, "-m", "mcp_saga.examples.trivial"], cwd=str(REPO)),
        "http": ServerConfig(url=trivial_http),
    }
    with SessionPool(servers) as pool:
        for name in servers:
            results = [pool.call_tool(name, "noop", {"n": n}) for n in range(20)]
            assert [r["structuredContent"] for r in results] == [{"n": n} for n in range(20)]
            assert results[0]["isError"] is False  # wire form: camelCase, as events carry it
            declarations = pool.tools(name)
            assert declarations["noop"].parsed_recovery().compensating_operation.operation_id == "noop_undo"
            assert declarations["noop_undo"].declares_argument("idempotencyKey")
            assert pool.connects(name) == 1


def test_calls_from_many_threads_share_the_session() -> None:
    with SessionPool({"s": scratch_stdio()}) as pool:
        pids: list[int] = []
        threads = [
            threading.Thread(target=lambda: pids.append(pool.call_tool("s", "pid")["structuredContent"]["result"]))
            for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(pids) == 8 and len(set(pids)) == 1
        assert pool.connects("s") == 1


def test_a_call_past_its_timeout_raises_call_timeout_and_the_session_stays_usable() -> None:
    with SessionPool({"s": scratch_stdio()}) as pool:
        pool.call_tool("s", "pid")
        with pytest.raises(CallTimeout) as caught:
            pool.call_tool("s", "slow", {"seconds": 30}, timeout=0.3)
        assert caught.value.retryable
        assert pool.call_tool("s", "slow", {"seconds": 0})["structuredContent"] == {"result": "done"}
        assert pool.connects("s") == 1


def test_a_stdio_server_that_dies_is_a_transport_error_then_a_fresh_session() -> None:
    with SessionPool({"s": scratch_stdio()}) as pool:
        first = pool.call_tool("s", "pid")["structuredContent"]["result"]
        with pytest.raises(TransportError) as caught:
            pool.call_tool("s", "die")
        assert caught.value.retryable and "Connection closed" in str(caught.value)
        second = pool.call_tool("s", "pid")["structuredContent"]["result"]
        assert second != first and pool.connects("s") == 2


def test_an_http_server_down_then_up_again(scratch_http: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = scratch_http
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with SessionPool({"h": ServerConfig(url=url, timeout=5)}) as pool:
        pool.call_tool("h", "pid")
        stop(proc)
        # a broken session (the lean call cannot connect), then a refused reconnect (the SDK): both retryable
        for _ in range(2):
            with pytest.raises(TransportError, match=r"ConnectError|could not connect"):
                pool.call_tool("h", "pid")
        again = subprocess.Popen([sys.executable, "-c", SCRATCH, str(port)], cwd=REPO, stderr=subprocess.DEVNULL)
        try:
            wait_until_accepting("127.0.0.1", port, again)
            assert pool.call_tool("h", "slow", {"seconds": 0})["structuredContent"] == {"result": "done"}
        finally:
            stop(again)


def test_a_server_that_never_answers_is_a_timeout() -> None:
    """Accepts the connection, reads the request, says nothing: the call must not hang the job."""
    with _Recorder(answer=False) as recorder:
        mute = ServerConfig(url=recorder.url, timeout=0.5)
        with SessionPool({"mute": mute}) as pool, pytest.raises(CallTimeout):
            pool.call_tool("mute", "noop")


def test_http_headers_come_from_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGA_TEST_TOKEN", "Bearer s3cret")
    with _Recorder(answer=True) as recorder:
        config = ServerConfig(url=recorder.url, headers_from_env={"Authorization": "SAGA_TEST_TOKEN"}, timeout=5)
        with SessionPool({"api": config}) as pool, pytest.raises(TransportError):
            pool.call_tool("api", "noop")  # the recorder answers 500: no session, but we saw the request
    assert recorder.headers and all(h.get("Authorization") == "Bearer s3cret" for h in recorder.headers)


def test_unknown_servers_are_refused_without_connecting() -> None:
    with SessionPool({}) as pool, pytest.raises(UnknownServer):
        pool.call_tool("http://127.0.0.1:1/mcp", "noop")


def test_close_is_idempotent_and_final() -> None:
    pool = SessionPool({"s": scratch_stdio()})
    pool.call_tool("s", "pid")
    pool.close()
    pool.close()
    with pytest.raises(TransportError):
        pool.call_tool("s", "pid")


class _Recorder:
    """An HTTP endpoint that records request headers and answers 500, or never answers at all."""

    def __init__(self, answer: bool):
        self.headers: list[dict[str, str]] = []
        self.release = threading.Event()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                recorder.headers.append(dict(self.headers))
                if not answer:
                    recorder.release.wait(10)
                    return
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_DELETE = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/mcp"

    def __enter__(self) -> _Recorder:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_rq_still_has_the_private_names_a_slot_worker_relies_on(redis_url: str) -> None:
    """RQ is pinned because of these; a version that renames them must fail here, not in a worker."""
    from mcp_saga.workers.process import SlotWorker
    from rq import SimpleWorker

    for name in ("_install_signal_handlers", "dequeue_job_and_maintain_ttl"):
        assert callable(getattr(SimpleWorker, name, None)), name
        assert name in vars(SlotWorker)  # overridden, so a slot never touches signals
    assert "_stop_requested" in vars(SimpleWorker([], connection=redis.Redis.from_url(redis_url)))
    # workers/healing.py repeats RQ's start-up of its scheduler to start the one that heals.
    import inspect

    from mcp_saga.workers.healing import HealingWorker
    from rq.scheduler import RQScheduler

    assert "RQScheduler(" in inspect.getsource(SimpleWorker._start_scheduler)
    assert "_start_scheduler" in vars(HealingWorker)
    for name in ("_install_signal_handlers", "_stop_requested", "should_reacquire_locks", "interval"):
        assert hasattr(RQScheduler([], connection=redis.Redis.from_url(redis_url)), name), name


def test_a_server_gets_at_most_per_server_slots_and_others_are_unaffected() -> None:
    nowhere = ServerConfig(url="http://127.0.0.1:1/mcp")  # nothing connects: slots are local bookkeeping
    pool = SessionPool({"a": nowhere, "b": nowhere}, per_server=2)
    with pool.slot("a") as first, pool.slot("a") as second:
        with pool.slot("a") as third:
            assert (first, second, third) == (True, True, False)
        with pool.slot("b") as other:
            assert other
    with pool.slot("a") as again:
        assert again  # released on the way out, also for the one that got none


def test_a_busy_server_is_waited_for_and_a_stuck_one_is_not() -> None:
    pool = SessionPool({"a": ServerConfig(url="http://127.0.0.1:1/mcp")}, per_server=1)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pool.slot("a"):
            taken.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    threading.Timer(0.2, release.set).start()  # a holder that lets go well within SLOT_PATIENCE
    with pool.slot("a") as free:
        assert free  # waited for the place instead of giving up
    holder.join()
    taken.clear()
    release.clear()
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    with pool.slot("a") as free:  # held past SLOT_PATIENCE: stuck, so no place
        assert not free
    release.set()
    holder.join()
