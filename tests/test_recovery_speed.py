"""Recovery after a crash in the middle of an unwind, with the default settings (issue 15, item 1).

Real processes: a redis-server, the trivial example server over streamable HTTP (each undo takes a
second), one coordinator and one worker started from a config that sets nothing but the server.
While the first compensation's call is in flight, the coordinator, the worker and the worker's RQ
scheduler child are all SIGKILLed; a new coordinator and a new worker are started. The unwind must
resume (the killed call dispatched again) and finish in LIFO order. How long it took is printed,
not asserted (the figure goes into the README's Performance table): the dead worker's lease expires
within `worker.lease`, and the watchdog, which looks at the lease, dispatches again `watchdog_after`
after its last sign of life, with no RQ scheduler on the way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import redis
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import Keys
from processes import saga_process, start_http_servers, stop, wait_for
from test_worker_faults import arrivals, children

K = Keys()
STEPS = 3


def step(n: int) -> StepCompleted:
    return StepCompleted(
        step=f"s{n}", server="trivial", tool="noop", arguments={"n": n}, result={"structuredContent": {"n": n}},
        recovery=compensation("noop_undo", n="$response.body#/n"),
    )  # fmt: skip


def kill_tree(proc: object) -> None:
    """SIGKILL a process and its direct children (RQ forks its scheduler, which would outlive it)."""
    orphans = children(proc.pid)  # type: ignore[attr-defined]
    stop(proc, sig=signal.SIGKILL)  # type: ignore[arg-type]
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_an_unwind_resumes_and_finishes_after_its_coordinator_and_worker_are_killed(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    seen = tmp_path / "arrivals"
    with start_http_servers(
        ("mcp_saga.examples.trivial", "--delay", "1"), env={"SAGA_TRIVIAL_ARRIVALS": str(seen)}
    ) as [(_, url)]:
        config = write_config(parse_config({"servers": {"trivial": {"url": url}}}), tmp_path / "saga.toml")
        assert config.read_text().strip().splitlines()[0] == "[servers.trivial]"  # defaults for everything else
        first = [
            saga_process("coordinator", redis_url=redis_url, config=config, log=tmp_path / "c1.log"),
            saga_process("worker", redis_url=redis_url, config=config, log=tmp_path / "w1.log"),
        ]
        later: list = []
        try:
            pipe = r.pipeline()
            for n in range(1, STEPS + 1):
                pipe.xadd(K.events, entry_fields("crash-1", step(n)))
            pipe.xadd(K.events, entry_fields("crash-1", WorkflowFailed(reason="boom")))
            pipe.execute()
            wait_for(lambda: STEPS in arrivals(seen), 60, "the last step's undo to reach the server")
            assert r.exists(K.lease("crash-1", f"s{STEPS}")), "the call in flight holds its lease"
            for proc in first:
                kill_tree(proc)
            killed = time.monotonic()
            later += [
                saga_process("coordinator", redis_url=redis_url, config=config, log=tmp_path / "c2.log"),
                saga_process("worker", redis_url=redis_url, config=config, log=tmp_path / "w2.log"),
            ]
            wait_for(lambda: arrivals(seen).count(STEPS) == 2, 150, "the killed call to be dispatched again")
            resumed = time.monotonic() - killed
            wait_for(lambda: r.hget(K.state("crash-1"), "status") == b"compensated", 60, "the unwind to finish")
            finished = time.monotonic() - killed
        finally:
            for proc in later:
                stop(proc)
            for proc in first:
                if proc.poll() is None:
                    kill_tree(proc)
    print(f"\nrecovery after SIGKILL of coordinator and worker: resumed {resumed:.1f} s, finished {finished:.1f} s")
    calls = arrivals(seen)
    assert calls == [3, 3, 2, 1], calls  # the killed call again (same key), then the rest, last first
