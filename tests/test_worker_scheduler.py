"""RQ's scheduler child under a worker's death and a lock it cannot take: real worker processes.

Retries and deferred compensations come back only through a scheduler. RQ's own would outlive a
SIGKILLed worker (holding the queue's scheduler lock for as long as it lives), and a worker that
found the lock taken would look again ten minutes later. Both gaps are closed in
workers/healing.py; these tests kill and block for real.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

import redis
from mcp_saga.cli.redis_server import RedisServer
from mcp_saga.runtime.failpoints import FAILPOINTS_ENV
from processes import stop, wait_for
from rq import Queue
from rq.job import JobStatus
from rq.scheduler import SCHEDULER_KEY_TEMPLATE
from test_worker_faults import children
from test_worker_job import FAST, K, start_worker, write_config

LOCK = f"rq:scheduler-lock:{K.queue}"


def schedulers(worker: int) -> list[int]:
    """The worker's scheduler children (spawned: multiprocessing's resource tracker is a child too)."""
    return [pid for pid in children(worker) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def running(r: redis.Redis) -> bool:
    """A scheduler child is in its loop: it registered itself (a child killed while it was still
    being spawned never gets that far, and the lock its worker took for it lapses instead)."""
    return bool(r.keys(SCHEDULER_KEY_TEMPLATE % "*"))


def test_the_scheduler_of_a_sigkilled_worker_stops_and_frees_its_lock(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(private_redis.url)
    config = write_config(tmp_path / "saga.toml", {}, worker=FAST)
    first = start_worker(private_redis.url, config, "w-first", tmp_path / "first.log")
    try:
        [scheduler] = wait_for(lambda: schedulers(first.pid) or None, 60, "the scheduler child")
        wait_for(lambda: r.get(LOCK) and running(r), 30, "the scheduler to run")
    finally:
        stop(first, sig=signal.SIGKILL)
    # RQ's scheduler lives on after its worker: this one notices its new parent and lets go.
    wait_for(lambda: not alive(scheduler), 30, "the orphaned scheduler to exit")
    assert r.get(LOCK) is None  # released, not left to expire
    assert "scheduler stopping: its worker is gone" in (tmp_path / "first.log").read_text()


def test_a_worker_that_found_the_lock_taken_runs_the_scheduler_once_it_is_free(
    private_redis: RedisServer, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(private_redis.url)
    r.set(LOCK, "a-scheduler-that-died", ex=4)  # what a SIGKILLed scheduler leaves, until it expires
    config = write_config(tmp_path / "saga.toml", {}, worker=FAST)
    worker = start_worker(private_redis.url, config, "w-late", tmp_path / "worker.log")
    try:
        job = Queue(K.queue, connection=r).enqueue_in(timedelta(seconds=1), "os.getcwd")
        # RQ would wait for its next maintenance run (ten minutes) before looking at the lock again.
        wait_for(lambda: job.get_status(refresh=True) == JobStatus.FINISHED, 60, "the scheduled job to run")
        holder = r.get(LOCK)
        assert holder is not None and holder != b"a-scheduler-that-died"
        assert schedulers(worker.pid)  # the scheduler it started
    finally:
        assert stop(worker) == 0
    assert "scheduler started" in (tmp_path / "worker.log").read_text()


def test_a_stopped_worker_stops_its_scheduler_too(private_redis: RedisServer, tmp_path: Path) -> None:
    r = redis.Redis.from_url(private_redis.url)
    config = write_config(tmp_path / "saga.toml", {}, worker=FAST)
    worker = start_worker(private_redis.url, config, "w-term", tmp_path / "worker.log")
    [scheduler] = wait_for(lambda: schedulers(worker.pid) or None, 60, "the scheduler child")
    assert stop(worker) == 0
    wait_for(lambda: not alive(scheduler), 10, "the scheduler to exit with its worker")
    assert r.get(LOCK) is None


def test_a_worker_stopped_while_its_scheduler_is_spawned_stops_warm(private_redis: RedisServer, tmp_path: Path) -> None:
    """RQ installs its signal handlers only after the scheduler's start: a SIGTERM in between
    killed the worker with the signal (exit -15) and left the lock held. The fail point holds the
    worker in that window for two seconds, so the SIGTERM lands there every time."""
    r = redis.Redis.from_url(private_redis.url)
    config = write_config(tmp_path / "saga.toml", {}, worker=FAST)
    held = {FAILPOINTS_ENV: "worker.scheduler-spawned=sleep(2000)"}
    worker = start_worker(private_redis.url, config, "w-early", tmp_path / "worker.log", env=held)
    [scheduler] = wait_for(lambda: schedulers(worker.pid) or None, 60, "the scheduler child")
    assert stop(worker) == 0  # the warm stop, once the worker has started
    wait_for(lambda: not alive(scheduler), 10, "the scheduler to exit with its worker")
    assert r.get(LOCK) is None
    assert "stop requested while starting" in (tmp_path / "worker.log").read_text()
