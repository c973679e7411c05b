"""The worker process: an RQ `SimpleWorker` on the saga queue with warm MCP sessions.

`SimpleWorker` runs jobs in the worker process itself; the forking `Worker` would start each job
in a fresh child, losing every session (a stdio server costs 0.6-0.9 s to start) and about 15 ms
of CPU per fork. The scheduler is on because RQ's retry intervals park jobs that only a
scheduler brings back. Signals are RQ's: SIGTERM or SIGINT finish the job in hand and stop (a
second one stops at once); the sessions are closed from their owning tasks on the way out.

A process runs `[worker] concurrency` RQ workers over one session pool: the main thread's (which
owns the signals and the scheduler) and the others in threads. A compensation is mostly waiting
for its MCP call, so one process with several slots overlaps one job's call with another's RQ
bookkeeping instead of doing them one after the other.

A slot in a thread needs three of RQ's private names (`_install_signal_handlers`,
`dequeue_job_and_maintain_ttl`, `_stop_requested`): RQ's public stop, `request_stop`, installs
signal handlers, which only the main thread may do, and RQ has no public hook for a worker that
is not the process. So RQ is pinned to the range known to work (`pyproject.toml`: 3.0, which this
suite runs on; the per-job steps workers/healing.py and workers/bookkeeping.py override have 3.0's
signatures), and `tests/test_worker_sessions.py` checks that the names still exist, so a newer RQ
that renames them fails in CI, not in a worker.
Every RQ worker of the process is a `HealingWorker` (workers/healing.py): a Redis that refuses
writes for a while (OOM, READONLY) is waited out, never a reason to exit.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from functools import partial
from types import FrameType
from typing import Any

from mcp_saga.runtime.connect import check_layout, connect, connect_queue
from mcp_saga.runtime.failpoints import fail_point
from mcp_saga.runtime.logs import configure, get_logger
from mcp_saga.runtime.metrics import CountingRetry
from mcp_saga.runtime.redis_checks import check_redis
from mcp_saga.schemas.config import Config
from mcp_saga.workers.bookkeeping import remember_serializers
from mcp_saga.workers.healing import HealingWorker
from mcp_saga.workers.job import clear_context, session_pool, set_context
from mcp_saga.workers.watchdog import WatchdogDeathPenalty
from redis.backoff import ExponentialWithJitterBackoff
from redis.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue
from rq.utils import now

log = get_logger("worker")
# Seconds between two of RQ's idle heartbeats (its worker key lives `worker_ttl`, 420 s).
HEARTBEAT_EVERY = 10.0


class SagaWorker(HealingWorker):
    """A `HealingWorker` (workers/healing.py) without the idle heartbeats nobody reads between two jobs.

    RQ beats (HSET and two EXPIREs) before and after every dequeue, each its own round trip, and
    again in its suspension check: nine commands and six round trips per job for a key whose TTL
    is `worker_ttl` (seven minutes). Those idle beats are sent at most every HEARTBEAT_EVERY
    seconds; the ones that set a job's TTL (in its own bookkeeping) are always sent.
    """

    def defer_stops(self) -> None:
        """Hold a SIGTERM or SIGINT that arrives while the worker starts until its loop's first look.

        RQ installs its handlers only after its bootstrap and its scheduler's start: a stop asked in
        between (a rolling deploy right after a scale-up) killed the worker with the signal, and the
        scheduler child it was spawning died before it had its state, leaving the queue's scheduler
        lock held until it expired. RQ's own handler there would raise StopRequested outside its
        loop. This one asks for the warm stop that the loop then makes; a second signal is RQ's
        cold stop.
        """
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, self._stop_when_started)

    def _stop_when_started(self, signum: int, frame: FrameType | None) -> None:
        if self._stop_requested:
            raise SystemExit()
        self._stop_requested = True
        self._shutdown_requested_date = now()
        log.info("stop requested while starting: stopping once started", worker=self.name, signal=signum)

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        self.defer_stops()
        super().bootstrap(*args, **kwargs)

    def prepare_execution(self, job: Any) -> Any:
        # Between RQ's dequeue (the job left the queue's list) and its start, a death leaves the job
        # `queued` in no list: what the watchdog must not take for a job waiting for a worker.
        fail_point("worker.after-dequeue")
        return super().prepare_execution(job)

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        if timeout is None and time.monotonic() - self._beaten < HEARTBEAT_EVERY:
            return
        self._beaten = time.monotonic()
        super().heartbeat(timeout, pipeline)

    _beaten = float("-inf")


class SlotWorker(SagaWorker):
    """An extra job slot in a thread of the worker process.

    Only the main thread may install signal handlers and use SIGALRM, so a slot installs none and
    times jobs out with the process's one watchdog thread (workers/watchdog.py); it waits for jobs a
    second at a time so that it notices within a second that the process is stopping (RQ's own wait
    only ends with a job).
    """

    death_penalty_class = WatchdogDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):  # type: ignore[no-untyped-def]
        if timeout is None:  # burst: one look at the queue
            return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        while not self._stop_requested:
            result = super().dequeue_job_and_maintain_ttl(1, max_idle_time=1)
            if result is not None:
                return result
        return None


def run_worker(
    redis_url: str,
    config: Config,
    *,
    name: str | None = None,
    burst: bool = False,
    logging_level: str = "INFO",
) -> int:
    """Work the queue until stopped (or, with `burst`, until it is empty); returns the exit status."""
    if not logging.getLogger("saga").handlers:  # `saga worker` configured them already
        configure(logging_level)
    remember_serializers()
    # redis-py's from_url connects without retries: a Redis restart during a job then escaped RQ's
    # failure handling and ended the process. With these, a restart of a few seconds goes unnoticed.
    retry = CountingRetry("worker", ExponentialWithJitterBackoff(base=0.01, cap=1.0), 10)
    # State and reports on `redis_url` (a cluster with `[redis] cluster`), jobs on the queue's Redis.
    connection = connect(redis_url, config.redis, retry=retry)
    jobs = connect_queue(redis_url, config.redis, retry=retry) if config.redis.queue_url else connection
    try:  # an evicting policy raises RedisSetupError (unless allowed); no persistence is a loud warning
        for client in dict.fromkeys([connection, jobs]):
            check_redis(client, allow_eviction=config.redis.allow_eviction, log=log)
        check_layout(connection, config.keys())
    except (RedisConnectionError, RedisTimeoutError) as exc:
        log.warning("could not check the redis setup at start-up", error=str(exc))
    queue = Queue(config.keys().queue, connection=jobs)
    worker = SagaWorker([queue], connection=jobs, name=name)
    worker.connect_scheduler = partial(connect_queue, redis_url, config.redis, retry=retry)
    worker.defer_stops()  # from here on a stop is a warm one: the slots below start before RQ's handlers
    slots = [
        SlotWorker([queue], connection=jobs, name=f"{worker.name}.{i}") for i in range(1, config.worker.concurrency)
    ]
    for each in (worker, *slots):  # one Redis: a job's own reads and report ride in RQ's MULTIs
        each.carry = jobs is connection
    threads = [
        threading.Thread(target=slot.work, kwargs={"burst": burst, "logging_level": logging_level}, daemon=True)
        for slot in slots
    ]
    pool = session_pool(config)
    set_context(connection, config, pool, worker.name)
    log.info(
        "worker started",
        worker=worker.name,
        queue=queue.name,
        slots=len(slots) + 1,
        servers=",".join(config.servers) or "none",
    )
    for thread in threads:
        thread.start()
    try:
        worker.work(burst=burst, with_scheduler=True, logging_level=logging_level)
        if burst:  # slots stop on an empty queue; a retry they queued after the main worker left is still due
            for thread in threads:
                thread.join()
            # Retries and deferred jobs, until done or a stop was asked.
            while not worker._stopping() and (queue.count or queue.scheduled_job_registry.count):
                if not queue.count:
                    time.sleep(0.2)  # not due yet: the scheduler of the next round enqueues it when it is
                worker.work(burst=True, with_scheduler=True, logging_level=logging_level)
    finally:
        for slot in slots:  # each finishes the job in hand, as the main worker did
            slot._stop_requested = True
        for thread in threads:
            thread.join()
        pool.close()
        clear_context()
        for client in dict.fromkeys([connection, jobs]):
            client.close()
    return 0
