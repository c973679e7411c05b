"""A worker survives a full Redis (issue 11, item 5): real redis-server, real `saga` processes.

Before the fix, RQ's own heartbeat, state change and dequeue met the OOM and ended each job slot
("found an unhandled exception, quitting"), and the scheduler child died on its first heartbeat
with the OOM inside a MULTI (ExecAbortError); a retry parked for later was then never brought
back, as only a scheduler does that (the worker restarts a dead one ten minutes later).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from mcp_saga.schemas.config import dump_config, parse_config
from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import Keys
from processes import REPO, free_port, saga_process, stop, wait_for, wait_until_accepting
from rq import Queue, Worker
from rq.scheduler import SCHEDULER_KEY_TEMPLATE

K = Keys()

# Its compensating tool fails once (retryable) and then succeeds, so the unwind needs a retry that
# RQ parks as scheduled: only a live scheduler brings it back.
FLAKY = """
import sys
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool

app = MCPServer("flaky", log_level="WARNING")
CALLS = sys.argv[2]

@recoverable_tool(app, compensation("undo", id="$response.body#/id"))
def do() -> dict:
    return {"id": "x"}

@app.tool()
def undo(id: str) -> str:
    with open(CALLS, "a") as calls:
        calls.write(id + "\\n")
    with open(CALLS) as calls:
        if len(calls.read().splitlines()) == 1:
            raise ToolError("not yet")
    return "undone " + id

app.run("streamable-http", port=int(sys.argv[1]))
"""
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$response.body#/id"}},
}


@pytest.fixture
def private_redis() -> Iterator[redis.Redis]:
    """A redis-server of the test's own: the test sets its maxmemory."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary).start()
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()
        server.cleanup()


def _url(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def _scheduler_beats(client: redis.Redis) -> list[datetime]:
    beats = []
    for key in client.scan_iter(SCHEDULER_KEY_TEMPLATE % "*"):
        raw = client.hget(key, "last_heartbeat")
        if raw:
            beats.append(datetime.fromisoformat(raw.decode().replace("Z", "+00:00")))
    return beats


def test_a_full_redis_is_waited_out_by_every_slot_and_the_scheduler(private_redis: redis.Redis, tmp_path: Path) -> None:
    r, url = private_redis, _url(private_redis)
    calls, port = tmp_path / "calls", free_port()
    server = subprocess.Popen([sys.executable, "-c", FLAKY, str(port), str(calls)], cwd=REPO, stderr=subprocess.DEVNULL)
    settings = parse_config(
        {
            "servers": {"svc": {"url": f"http://127.0.0.1:{port}/mcp", "timeout": 5}},
            "coordinator": {"block_ms": 50},
            "worker": {"concurrency": 3, "backoff_base": 1, "backoff_max": 1, "jitter": 0},
        }
    )
    config = tmp_path / "saga.toml"
    config.write_text(dump_config(settings))
    worker_log = tmp_path / "w.log"
    procs: list[subprocess.Popen[bytes]] = []
    queue = Queue(K.queue, connection=r)
    try:
        wait_until_accepting("127.0.0.1", port, server)
        procs.append(saga_process("coordinator", redis_url=url, config=config, log=tmp_path / "c.log"))
        worker = saga_process("worker", redis_url=url, config=config, log=worker_log)
        procs.append(worker)
        slots = settings.worker.concurrency
        wait_for(lambda: len(Worker.all(queue=queue)) == slots, 30, "every slot of the worker to register")
        wait_for(lambda: bool(_scheduler_beats(r)), 30, "the scheduler to start")

        r.config_set("maxmemory", 1)  # every write that may grow memory is refused with OOM
        try:
            # Slots write a heartbeat each second and the scheduler beats each second: all meet it.
            wait_for(lambda: "redis refused a write" in worker_log.read_text(), 30, "the worker to meet the OOM")
            time.sleep(3)
        finally:
            r.config_set("maxmemory", 0)
        healed = datetime.now().astimezone()

        assert worker.poll() is None, worker_log.read_text()[-3000:]
        wait_for(
            lambda: any(beat > healed for beat in _scheduler_beats(r)), 30, "the scheduler to beat after Redis healed"
        )

        def slots_beating() -> bool:
            workers = Worker.all(queue=queue)
            beaten = [w for w in workers if w.last_heartbeat is not None and w.last_heartbeat > healed]
            # The main worker waits for jobs in one long blocking call, which an OOM never reaches.
            return len(workers) == slots and len(beaten) >= slots - 1

        wait_for(slots_beating, 30, "every job slot to be registered and beating after Redis healed")

        result = {"structuredContent": {"id": "x"}}
        step = StepCompleted(step="a", server="svc", tool="do", result=result, recovery=RECOVERY)
        r.xadd(K.events, entry_fields("after-oom", step))
        r.xadd(K.events, entry_fields("after-oom", WorkflowFailed(reason="boom")))
        wait_for(lambda: r.hget(K.state("after-oom"), "status") == b"compensated", 60, "the unwind after the OOM")
        assert calls.read_text().splitlines() == ["x", "x"]  # the retry the scheduler brought back
        assert worker.poll() is None
        text = worker_log.read_text()
        assert "unhandled exception" not in text and "raised an exception" not in text, text[-3000:]
    finally:
        r.config_set("maxmemory", 0)
        for proc in procs:
            assert stop(proc) == 0
        stop(server)


def test_a_retry_whose_status_write_is_refused_is_waited_out_and_keeps_its_budget(
    private_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RQ's `Job.retry` writes the job's `scheduled` status outside the failure's pipeline: an OOM
    there escaped `handle_job_failure` and RQ's loop quit ("found an unhandled exception"). The
    reduced chaos run caught a worker's every slot ending that way while Redis was held full; the
    heartbeat waited for before it had been taken, and the next write was refused. The refusal is
    waited out, and the retry counts once."""
    from mcp_saga.workers.healing import HealingWorker
    from redis.exceptions import OutOfMemoryError
    from rq import Retry
    from rq.job import Job, JobStatus

    queue = Queue("heal", connection=private_redis)
    job = queue.enqueue("builtins.len", "x", retry=Retry(max=2, interval=[30, 30]))
    worker = HealingWorker([queue], connection=private_redis, name="heal-1")
    real, refused = Job.set_status, []

    def refuse_once(self: Job, status: JobStatus, pipeline: Any = None) -> None:
        if status == JobStatus.SCHEDULED and not refused:
            refused.append(status)
            raise OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        real(self, status, pipeline=pipeline)

    monkeypatch.setattr(Job, "set_status", refuse_once)
    worker.handle_job_failure(job, queue, exc_string="boom")
    assert refused
    job.refresh()
    assert job.get_status() == JobStatus.SCHEDULED and job.retries_left == 1
    assert job.id in queue.scheduled_job_registry


@pytest.mark.timeout(30)
def test_a_worker_stops_reading_rqs_command_channel_at_once(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RQ's command channel thread polls every 60 s, and redis-py (8.2 on) waits for its poll when it
    stops, so every teardown of a worker (and of each slot) took a minute; ours polls every PUBSUB_POLL.

    The minute is lost when the thread reads the UNSUBSCRIBE's reply before RQ asks it to stop (it
    then waits for a subscription): a busy worker's case, made certain here by a stop that comes late."""
    from mcp_saga.workers.healing import PUBSUB_POLL, HealingWorker
    from redis.client import PubSubWorkerThread

    stop = PubSubWorkerThread.stop
    monkeypatch.setattr(PubSubWorkerThread, "stop", lambda thread, *a: time.sleep(0.5) or stop(thread, *a))
    client = redis.Redis.from_url(redis_url)
    worker = HealingWorker([Queue("pubsub-test", connection=client)], connection=client, name="pubsub-test")
    worker.subscribe()
    try:
        wait_for(lambda: client.pubsub_numsub(worker.pubsub_channel_name)[0][1] == 1, 10, "the subscription")
    finally:
        started = time.monotonic()
        worker.unsubscribe()
        took = time.monotonic() - started
    assert not worker.pubsub_thread.is_alive()
    assert client.pubsub_numsub(worker.pubsub_channel_name)[0][1] == 0
    assert took < 10 * PUBSUB_POLL + 5, f"stopping the channel's thread took {took:.1f} s"
    client.close()
