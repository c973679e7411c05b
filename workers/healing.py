"""RQ's worker and scheduler loops, made to wait out a Redis that refuses writes for a while.

RQ ends a worker's loop on any Redis error but a lost connection: under `maxmemory` (noeviction)
the first heartbeat, state change or dequeue that meets the OOM ends the slot ("found an unhandled
exception, quitting"), and the scheduler child dies on its next heartbeat (the OOM inside a MULTI);
the worker restarts a dead scheduler only at its next maintenance run, ten minutes later, and until
then no retry parked by RQ comes back. Under a supervisor that is a crash loop while memory stays
full. Every condition `healing_condition` names (OOM, READONLY, MISCONF, ...) ends by itself or by
an operator's hand, so these loops wait it out instead, with a rate-limited warning.

What is retried is each of RQ's steps that writes and can run again after a refusal without doing
anything twice: a single idempotent command (a heartbeat's HSET), or a MULTI/EXEC (RQ's pipelines
are transactions), which Redis discards whole when one queued command is refused. A dequeue that
is refused moved nothing; one that succeeded is never repeated, since the heartbeat after it waits
on its own. Nothing is acknowledged meanwhile: a job's result, retry or failure is written only
once Redis takes it. The one step RQ itself swallows a refusal of (persisting a job's failure, and
with it the retry it schedules) is preceded by a wait until Redis takes a heartbeat again.

RQ's scheduler is a child process the worker forks, and RQ leaves two gaps around it: a child
whose worker was SIGKILLed lives on, holding the scheduler lock of the queue, and a worker that
did not get that lock (its holder was alive, or a dead one's lock had not expired yet) tries
again only at its next maintenance run, ten minutes later. Retries and deferred jobs wait for a
scheduler meanwhile. So the scheduler here stops when its worker is gone (its parent changes),
and the worker looks for a live scheduler every SCHEDULER_CHECK_EVERY seconds while it waits for
jobs, taking the lock over as soon as it is free.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from mcp_saga.runtime.failpoints import fail_point
from mcp_saga.runtime.logs import configure, get_logger
from mcp_saga.runtime.redis_checks import MAX_REFUSAL_BACKOFF, RateLimitedLog, healing_condition
from mcp_saga.workers.bookkeeping import LeanWorker
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from rq import SimpleWorker
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import StopRequested
from rq.logutils import setup_loghandlers
from rq.scheduler import RQScheduler, run

log = get_logger("worker")
T = TypeVar("T")
_refused = RateLimitedLog(log)
# Seconds between a waiting worker's looks for a live scheduler (a lock is one SET NX; the lock of
# a scheduler that died without releasing it expires `interval + 60` seconds after its last beat).
SCHEDULER_CHECK_EVERY = 5
# Seconds between two polls of the thread that reads RQ's command channel: how long a stop waits for it.
PUBSUB_POLL = 0.2


def wait_out(call: Callable[[], T], stopping: Callable[[], bool], *, idle: bool) -> T:
    """`call()`, again after a backoff for as long as Redis refuses it with a condition that heals.

    When the process is stopping, an idle step ends the loop (StopRequested) and a job's step gives
    up with the refusal: the job is then RQ's abandoned job, and the coordinator's watchdog sees a
    silent compensation.
    """
    delay = 0.0
    while True:
        try:
            return call()
        except ResponseError as exc:
            condition = healing_condition(exc)
            if condition is None:
                raise
            if stopping():
                if idle:
                    raise StopRequested from exc
                raise
            delay = min(MAX_REFUSAL_BACKOFF, delay * 2 or 0.1)
            _refused.note(condition, str(exc), delay)
            time.sleep(delay)


class HealingScheduler(RQScheduler):
    """RQ's scheduler loop with each round waited out; the child process outlives a full Redis.

    RQ forks the child from a worker that already runs its slot threads and session loop, so the
    child inherits every lock one of them held at that instant (a logging or metrics lock, a
    connection pool's) with no thread left to release it. It is spawned here instead: a fresh
    interpreter (about 0.7 s, once per worker) that receives the scheduler pickled, as RQ does on
    platforms without fork. A client does not pickle (a Sentinel-managed pool holds the Sentinel
    itself), so the child connects anew with `connect`, the worker's own recipe for its queue's
    client; without one it rebuilds RQ's pool from its parts, which a plain `Redis` allows.
    """

    def __init__(
        self,
        *args: Any,
        logging_level: str | int = "INFO",
        connect: Callable[[], Redis] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, logging_level=logging_level, **kwargs)
        self._log_setup = (logging_level, kwargs.get("date_format"), kwargs.get("log_format"))
        self._connect = connect

    @property
    def connection(self) -> Redis:
        if self._connection is None and self._connect is not None:
            self._connection = self._connect()
        return super().connection

    def __getstate__(self) -> dict[str, Any]:
        # What holds a connection or a process handle stays in the worker; the child makes its own.
        state = {**self.__dict__, "_process": None, "_connection": None, "_scheduled_job_registries": []}
        if self._connect is not None:
            state["_pool_kwargs"] = {}
        return state

    def start(self) -> BaseProcess:
        self._status = self.Status.STARTED
        self._worker_pid = os.getpid()  # pickled with it: the child may be slower to look than the worker to die
        self._process = get_context("spawn").Process(target=run_scheduler, args=(self,), name="Scheduler")
        self._process.start()
        fail_point("worker.scheduler-spawned")
        return self._process

    def work(self) -> None:
        self._install_signal_handlers()
        worker = getattr(self, "_worker_pid", None) or os.getppid()  # a new parent: the worker is gone
        orphaned = lambda: os.getppid() != worker  # noqa: E731
        stopping = lambda: self._stop_requested or orphaned()  # noqa: E731 - read at each refusal
        try:
            wait_out(self.register_birth, stopping, idle=True)
            while not stopping():
                wait_out(self._round, stopping, idle=True)
                time.sleep(self.interval)
        except StopRequested:
            pass
        if orphaned():
            log.warning("scheduler stopping: its worker is gone", worker_pid=worker, queues=",".join(self._queue_names))
        self.stop()

    def set_up_logs(self) -> None:
        """The child's own log set-up: a spawned interpreter starts with none."""
        level, date_format, log_format = self._log_setup
        configure(logging.getLevelName(level) if isinstance(level, int) else level)
        setup_loghandlers(
            level=level,
            name=self.log.name,
            date_format=date_format or DEFAULT_LOGGING_DATE_FORMAT,
            log_format=log_format or DEFAULT_LOGGING_FORMAT,
        )

    def _round(self) -> None:
        # Lock and heartbeat are one script call each; moving due jobs is one MULTI per batch.
        if self.should_reacquire_locks:
            self.acquire_locks()
        self.heartbeat()
        self.enqueue_scheduled_jobs()

    def stop(self) -> None:
        try:
            super().stop()
        except ResponseError as exc:  # its lock and record expire by themselves within a minute
            if healing_condition(exc) is None:
                raise
            log.warning("scheduler stopped without releasing its lock: redis refused the write", error=str(exc)[:200])


def run_scheduler(scheduler: HealingScheduler) -> None:
    """The spawned child's entry point: RQ's own `run`, after the logs are set up."""
    scheduler.set_up_logs()
    run(scheduler)


class HealingWorker(LeanWorker):
    """An RQ SimpleWorker whose own bookkeeping (trimmed: workers/bookkeeping.py) waits out a Redis
    that refuses writes.

    `connect_scheduler` (picklable: a module-level function with its arguments) is how its
    spawned scheduler opens its client; run_worker sets it from the URL and the config.
    """

    connect_scheduler: Callable[[], Redis] | None = None

    def _stopping(self) -> bool:
        return bool(self._stop_requested)

    def _idle(self, call: Callable[[], T]) -> T:
        return wait_out(call, self._stopping, idle=True)

    def _busy(self, call: Callable[[], T]) -> T:
        return wait_out(call, self._stopping, idle=False)

    # Between jobs --------------------------------------------------------------------------

    def register_birth(self) -> None:
        self._idle(super().register_birth)

    def register_death(self) -> None:
        """The last write of a stopping worker, so any Redis error only costs a warning: its key
        expires by itself (worker_ttl + 60 s). Seen after a Sentinel failover: the MULTI came back
        with the wrong number of replies ("Wrong number of response items"), and the worker exited
        with a traceback after a clean stop."""
        try:
            super().register_death()
        except RedisError as exc:
            log.warning("worker stopped without unregistering", worker=self.name, error=str(exc)[:200])

    def subscribe(self) -> None:
        """RQ's command channel (`rq` stop-job, shutdown), its thread polling every PUBSUB_POLL seconds.

        RQ 3.0 polls every 60 s, and since redis-py 8.2 stopping that thread waits for its poll to
        end: after RQ's UNSUBSCRIBE the poll waits for a subscription that never comes, so every
        worker's (and every slot's) teardown took a minute."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_POLL, daemon=True, exception_handler=self._pubsub_exception_handler
        )

    def check_for_suspension(self, burst: bool) -> None:
        parent = super().check_for_suspension  # it writes a heartbeat in the same MULTI as its read
        self._idle(lambda: parent(burst))

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        parent = super().heartbeat
        self._idle(lambda: parent(timeout, pipeline))

    def set_state(self, state: str, pipeline: Any = None) -> None:
        parent = super().set_state
        self._idle(lambda: parent(state, pipeline))

    def run_maintenance_tasks(self) -> None:
        self._idle(super().run_maintenance_tasks)

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None):  # type: ignore[no-untyped-def]
        """RQ's wait for a job, in SCHEDULER_CHECK_EVERY slices with a look at the scheduler between."""
        parent = super().dequeue_job_and_maintain_ttl
        if timeout is None or self.scheduler is None:  # a burst's one look; a worker without a scheduler
            return self._idle(lambda: parent(timeout, max_idle_time))
        idle_since = time.monotonic()
        while True:
            self._keep_scheduler()
            waited = time.monotonic() - idle_since
            if max_idle_time is not None and waited >= max_idle_time:
                return None
            piece = SCHEDULER_CHECK_EVERY
            if max_idle_time is not None:
                piece = max(1, min(piece, int(max_idle_time - waited)))
            result = self._idle(partial(parent, piece, max_idle_time=piece))
            if result is not None:
                return result

    def _keep_scheduler(self) -> None:
        """Start a scheduler when none of this worker's is alive and the queue's lock is free."""
        scheduler = self.scheduler
        if scheduler is None or (scheduler._process is not None and scheduler._process.is_alive()):
            return
        if scheduler._process is not None:  # it died: reap it, and know it on the next look
            scheduler._process.join(0)
        if self._idle(lambda: scheduler.acquire_locks(auto_start=True)):
            log.info("scheduler started", worker=self.name, queues=",".join(scheduler.acquired_locks))

    def stop_scheduler(self) -> None:
        """RQ's stop (SIGTERM, join), then the locks let go of here too: a child stopped before it
        installed its handlers did not. A lock another scheduler holds by now stays (compare-and-delete)."""
        super().stop_scheduler()
        if self.scheduler is not None:
            scheduler = self.scheduler
            try:
                scheduler.release_locks()
            except (ResponseError, RedisConnectionError) as exc:  # it expires within a minute
                log.warning("scheduler lock not released", worker=self.name, error=str(exc)[:200])

    def _start_scheduler(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
        log_format: str = DEFAULT_LOGGING_FORMAT,
    ) -> None:
        """RQ's own start-up of its scheduler (rq/worker/base.py), with the scheduler that heals.

        RQ names its scheduler class in the method itself, so the method is repeated here; the
        test of RQ's private names (tests/test_worker_sessions.py) covers this one too.
        """
        self.scheduler = HealingScheduler(
            self.queues,
            connection=self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            date_format=date_format,
            log_format=log_format,
            serializer=self.serializer,
            connect=self.connect_scheduler,
        )
        scheduler = self.scheduler
        self._idle(scheduler.acquire_locks)
        if not scheduler.acquired_locks:
            return
        if not burst:
            scheduler.start()
            return
        try:
            self._idle(scheduler.register_birth)
            self._idle(scheduler.enqueue_scheduled_jobs)
        finally:
            scheduler.release_locks()
            scheduler.register_death()

    # Around a job ------------------------------------------------------------------------

    def prepare_execution(self, job: Any) -> Any:
        def attempt() -> Any:
            before = set(self.executions)
            try:
                return LeanWorker.prepare_execution(self, job)
            except ResponseError:  # the MULTI was discarded: forget the execution it would have made
                for key in set(self.executions) - before:
                    del self.executions[key]
                raise

        return self._busy(attempt)

    def prepare_job_execution(self, job: Any, remove_from_intermediate_queue: bool = False) -> None:
        parent = super().prepare_job_execution
        self._busy(lambda: parent(job, remove_from_intermediate_queue))

    def handle_execution_ended(self, job: Any, queue: Any, heartbeat_ttl: int) -> None:
        parent = super().handle_execution_ended
        self._busy(lambda: parent(job, queue, heartbeat_ttl))

    def handle_job_success(self, job: Any, queue: Any, started_job_registry: Any, execution: Any) -> None:
        parent = super().handle_job_success
        self._busy(lambda: parent(job, queue, started_job_registry, execution))

    def handle_job_retry(self, job: Any, queue: Any, retry: Any, started_job_registry: Any, execution: Any) -> None:
        parent = super().handle_job_retry
        self._busy(lambda: parent(job, queue, retry, started_job_registry, execution))

    def handle_job_failure(
        self, job: Any, queue: Any, started_job_registry: Any = None, exc_string: str = "", execution: Any = None
    ) -> None:
        # RQ logs and drops a refusal of this MULTI (and the retry it schedules): wait until Redis
        # takes a write first, so that the failure and its retry are kept.
        self._busy(lambda: SimpleWorker.heartbeat(self))
        # A retry writes the job's `scheduled` status outside the MULTI, and Redis may refuse that
        # write even right after the heartbeat was taken (the heartbeat itself can fill it): RQ lets
        # the refusal out of its loop, which ends. It is waited out too; the MULTI was not sent, so
        # the whole failure is handled again, with the retry budget as it was before.
        parent, left = super().handle_job_failure, job.retries_left

        def attempt() -> None:
            job.retries_left = left
            parent(job, queue, started_job_registry, exc_string, execution)

        self._busy(attempt)
