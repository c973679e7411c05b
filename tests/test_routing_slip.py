"""The routing slip with real processes (issue 15, item 2): one job carries the rest of the unwind.

A redis-server, two trivial example servers over streamable HTTP (the second fails its first
compensating call, as a transient error), one coordinator and one worker. Three steps unwind
last-first: the first job carries all three; the worker runs them in order, reports each, and
stops at the transient failure; the coordinator takes back what the slip still carried and
dispatches the failed step again with the rest behind it, after the configured backoff.
"""

from __future__ import annotations

from pathlib import Path

import redis
from mcp_saga.runtime.reader import Reader
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import Keys
from processes import saga_process, start_http_servers, stop, wait_for
from test_worker_faults import arrivals

K = Keys()


def step(n: int, server: str) -> StepCompleted:
    return StepCompleted(
        step=f"s{n}", server=server, tool="noop", arguments={"n": n}, result={"structuredContent": {"n": n}},
        recovery=compensation("noop_undo", n="$response.body#/n"),
    )  # fmt: skip


def test_one_worker_runs_the_rest_of_the_unwind_and_stops_at_a_failure(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    seen = tmp_path / "arrivals"
    with start_http_servers(
        ("mcp_saga.examples.trivial",),
        ("mcp_saga.examples.trivial", "--fail-first", "1"),
        env={"SAGA_TRIVIAL_ARRIVALS": str(seen)},
    ) as [(_, healthy), (_, flaky)]:
        servers = {"healthy": {"url": healthy}, "flaky": {"url": flaky}}
        config_model = parse_config({"servers": servers})
        config = write_config(config_model, tmp_path / "saga.toml")
        procs = [
            saga_process("coordinator", redis_url=redis_url, config=config, log=tmp_path / "c.log"),
            saga_process("worker", redis_url=redis_url, config=config, log=tmp_path / "w.log"),
        ]
        try:
            pipe = r.pipeline()
            for n, server in ((1, "healthy"), (2, "flaky"), (3, "healthy")):
                pipe.xadd(K.events, entry_fields("slip-1", step(n, server)))
            pipe.xadd(K.events, entry_fields("slip-1", WorkflowFailed(reason="boom")))
            pipe.execute()
            wait_for(lambda: r.hget(K.state("slip-1"), "status") == b"compensated", 60, "the unwind to finish")
        finally:
            for proc in procs:
                stop(proc)
    assert arrivals(seen) == [3, 2, 2, 1]  # last first; the failed call again before the step below it
    # The failed call was tried again only after the backoff any failed attempt waits (the earliest
    # its jitter allows), not at once: the re-dispatch was a job RQ's scheduler held until then.
    times = [float(line.split()[0]) for line in seen.read_text().splitlines()]
    assert times[2] - times[1] >= config_model.worker.backoff(0, -1) > 0
    comps = Reader(r, K).records("slip-1")[1]  # type: ignore[index]
    assert {s: (c.status, c.dispatch, c.spent) for s, c in comps.items()} == {
        "s3": ("succeeded", 1, 1),
        "s2": ("succeeded", 2, 2),  # its slip's attempt failed; dispatched again, with s1 behind it
        "s1": ("succeeded", 2, 1),  # taken back from the first slip unrun, run from the second
    }
    log = [f for _, f in r.xrange(K.log("slip-1"))]
    slipped = [f[b"step"] for f in log if f[b"type"] == b"compensation-dispatched" and b"detail" in f]
    assert slipped == [b"s2", b"s1", b"s1"]  # the steps that rode in a slip, each time they did
