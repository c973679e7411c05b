"""The worker under slow and hung servers: real worker processes, a real redis-server and the
trivial example server over streamable HTTP, slowed with `--delay`.

What the coordinator's watchdog relies on (issue 11, item 1): a lease that stays alive for as
long as a call is in flight, a report for every attempt, and at most `attempts` calls per
dispatch. What the other servers rely on (item 10): a hung server holds at most `per_server`
slots of a worker, so another server's compensation is done while the hung calls still wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp_saga.cli.redis_server import RedisServer
from processes import log_tails, start_http_servers, stop, wait_for
from test_worker_job import FAST, K, plan, reports, start_worker, write_config

NOOP = {"tool": "noop", "operation": "noop_undo"}


def children(pid: int) -> list[int]:
    """Direct child processes (Linux /proc): RQ forks its scheduler, which outlives a SIGKILLed worker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def arrivals(path: Path) -> list[int]:
    """The `n` of every noop_undo call the server received, in arrival order."""
    return [int(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_lease_lives_through_a_slow_call_and_every_timed_out_attempt_is_reported(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    seen = tmp_path / "arrivals"
    env = {"SAGA_TRIVIAL_ARRIVALS": str(seen)}
    with start_http_servers(
        ("mcp_saga.examples.trivial", "--delay", "3.0"), ("mcp_saga.examples.trivial", "--delay", "3600"), env=env
    ) as [(_, slow), (_, hung)]:
        # A lease of 1.2 s is renewed every 0.4 s: the call outlasts it 2.5 times, and only a stall
        # of 0.8 s (not 0.4 s, which a box at load 10 gave) lets it lapse.
        settings = {**FAST, "attempts": 3, "lease": 1.2}
        servers = {"slow": {"url": slow, "timeout": 10}, "hung": {"url": hung, "timeout": 1}}
        config = write_config(tmp_path / "saga.toml", servers, worker=settings)
        worker = start_worker(redis_url, config, "w-slow", tmp_path / "worker.log")
        try:
            plan(r, "slow-1", "s", {"n": 1}, server="slow", worker=settings, **NOOP)
            wait_for(lambda: 1 in arrivals(seen), what="the slow call to reach the server")
            # The call takes 2.5 leases; the heartbeat must keep the lease for all of it.
            lease = K.lease("slow-1", "s")
            while not reports(r, "slow-1"):
                assert r.exists(lease), "the lease lapsed while the call was in flight"
                time.sleep(0.05)
            [(kind, report)] = reports(r, "slow-1")
            assert kind == "compensation-succeeded" and (report.dispatch, report.attempt) == (1, 1)
            wait_for(lambda: not r.exists(lease), what="the lease to be released after the report")

            plan(r, "hung-1", "h", {"n": 2}, server="hung", worker=settings, **NOOP)
            wait_for(lambda: any(d.final for _, d in reports(r, "hung-1")), 60, "the final report")
        finally:
            stop(worker)
    got: list[Any] = [d for _, d in reports(r, "hung-1")]
    assert [(d.dispatch, d.attempt, d.final, d.retryable) for d in got] == [
        (1, 1, False, True),
        (1, 2, False, True),
        (1, 3, True, True),
    ]
    assert all(d.error == "hung: no answer within 1 s" for d in got)
    assert arrivals(seen).count(2) == 3  # one call per attempt, no more


def test_a_hung_server_does_not_hold_back_another_servers_compensation(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    seen = tmp_path / "arrivals"
    with start_http_servers(
        ("mcp_saga.examples.trivial", "--delay", "3600"),
        ("mcp_saga.examples.trivial",),
        env={"SAGA_TRIVIAL_ARRIVALS": str(seen)},
    ) as [(_, hung), (_, healthy)]:
        settings = {**FAST, "attempts": 2, "concurrency": 4, "job_timeout": 900}  # above the hung timeout
        servers = {"hung": {"url": hung, "timeout": 600}, "healthy": {"url": healthy}}
        config = write_config(tmp_path / "saga.toml", servers, worker=settings)
        # Six compensations to the hung server are queued ahead of the healthy one.
        for n in range(6):
            plan(r, f"hung-{n}", "h", {"n": n}, server="hung", worker=settings, **NOOP)
        plan(r, "healthy-1", "ok", {"n": 100}, server="healthy", worker=settings, **NOOP)
        worker = start_worker(redis_url, config, "w-iso", tmp_path / "worker.log")
        try:
            wait_for(lambda: reports(r, "healthy-1"), 60, "the healthy server's compensation")
            assert [kind for kind, _ in reports(r, "healthy-1")] == ["compensation-succeeded"]
            # Done while the hung server still holds its three slots (concurrency 4, per_server
            # 3) and nothing of it has been reported: it waited on none of those calls.
            wait_for(lambda: len([n for n in arrivals(seen) if n < 100]) >= 3, what="three hung calls")
            assert len([n for n in arrivals(seen) if n < 100]) == 3, arrivals(seen)
            assert not any(reports(r, f"hung-{n}") for n in range(6))
            assert "compensation deferred" in (tmp_path / "worker.log").read_text()
        finally:  # SIGKILL: SIGTERM would wait for the hung calls; RQ's scheduler child goes too
            orphans = children(worker.pid)
            stop(worker, sig=signal.SIGKILL)
            for pid in orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(200)
# Known to fail now and then on a loaded 2-core box for reasons not yet found (see the README's
# "Known flaky tests"); one rerun, and a second failure fails the suite.
@pytest.mark.flaky(reruns=1)
def test_a_deferred_compensation_runs_once_a_slot_is_free_without_using_an_attempt(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    # A Redis of its own: the continuation comes back through RQ's scheduler, whose lock a scheduler
    # child of an earlier test's worker (it outlives a SIGKILLed worker) could otherwise still hold.
    redis_url, r = private_redis.url, redis.Redis.from_url(private_redis.url)
    seen = tmp_path / "arrivals"
    with start_http_servers(
        # A call longer than SLOT_PATIENCE: the second job finds its server stuck, not just busy.
        ("mcp_saga.examples.trivial", "--delay", "3"),
        env={"SAGA_TRIVIAL_ARRIVALS": str(seen)},
    ) as [(_, slow)]:
        settings = {**FAST, "attempts": 2, "concurrency": 2, "per_server": 1}
        config = write_config(tmp_path / "saga.toml", {"slow": {"url": slow}}, worker=settings)
        for n in (1, 2):
            plan(r, f"slow-{n}", "s", {"n": n}, server="slow", worker=settings, **NOOP)
        worker = start_worker(redis_url, config, "w-defer", tmp_path / "worker.log")
        try:
            try:
                wait_for(lambda: all(reports(r, f"slow-{n}") for n in (1, 2)), 120, "both compensations")
            except AssertionError as exc:
                found = {n: reports(r, f"slow-{n}") for n in (1, 2)}
                scheduled = r.zrange(f"rq:scheduled:{K.queue}", 0, -1, withscores=True)
                lock = r.get(f"rq:scheduler-lock:{K.queue}")
                detail = f"reports {found}, scheduled {scheduled}, lock {lock}, arrivals {arrivals(seen)}"
                raise AssertionError(f"{exc}: {detail}\n{log_tails(tmp_path / 'worker.log', size=6000)}") from None
        finally:
            stop(worker)
    assert "compensation deferred" in (tmp_path / "worker.log").read_text()  # one waited for the other
    for n in (1, 2):
        [(kind, report)] = reports(r, f"slow-{n}")
        assert kind == "compensation-succeeded" and (report.dispatch, report.attempt) == (1, 1)
    assert sorted(arrivals(seen)) == [1, 2]  # each called once
