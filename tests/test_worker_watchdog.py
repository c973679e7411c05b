"""The slot threads' job timeout (workers/watchdog.py): RQ's TimerDeathPenalty's delivery, with one thread per
process instead of one per job."""

from __future__ import annotations

import threading
import time

from mcp_saga.workers import watchdog
from mcp_saga.workers.process import SlotWorker
from mcp_saga.workers.watchdog import WatchdogDeathPenalty
from rq.timeouts import JobTimeoutException, TimerDeathPenalty


def _overrun(timeout: int, caught: dict[str, BaseException | None], name: str) -> None:
    """A job that would run for ever, under its death penalty, as RQ's perform_job runs one."""
    caught[name] = None
    try:
        with WatchdogDeathPenalty(timeout, JobTimeoutException, job_id=name):
            while True:
                time.sleep(0.01)
    except JobTimeoutException as exc:
        caught[name] = exc


def test_an_overrunning_job_is_stopped_in_its_own_thread_with_rqs_exception_and_its_own_message() -> None:
    caught: dict[str, BaseException | None] = {}
    threads = [threading.Thread(target=_overrun, args=(n, caught, f"job-{n}")) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    assert {name: str(exc) for name, exc in caught.items()} == {
        "job-1": "Task exceeded maximum timeout value (1 seconds)",
        "job-2": "Task exceeded maximum timeout value (2 seconds)",
    }
    assert watchdog._WATCHDOG.armed() == 0


def test_a_job_that_ends_in_time_is_not_interrupted_later() -> None:
    with WatchdogDeathPenalty(1, JobTimeoutException, job_id="quick"):
        pass
    time.sleep(1.5)  # past the deadline it had: nothing is raised here
    assert watchdog._WATCHDOG.armed() == 0


def test_jobs_start_no_thread_and_leave_no_deadline_behind() -> None:
    with WatchdogDeathPenalty(60, JobTimeoutException, job_id="first"):
        pass
    threads = threading.active_count()
    keeper = watchdog._WATCHDOG._thread
    for n in range(10 * watchdog.COMPACT_AFTER):
        with WatchdogDeathPenalty(60, JobTimeoutException, job_id=f"job-{n}"):
            pass
    assert threading.active_count() == threads and watchdog._WATCHDOG._thread is keeper
    assert watchdog._WATCHDOG.armed() == 0
    assert len(watchdog._WATCHDOG._heap) <= 2 * watchdog.COMPACT_AFTER + 2  # cancelled entries are dropped


def test_the_slot_workers_time_jobs_out_with_it() -> None:
    assert issubclass(SlotWorker.death_penalty_class, WatchdogDeathPenalty)
    assert issubclass(WatchdogDeathPenalty, TimerDeathPenalty)  # RQ's delivery: handle_death_penalty is its own
    assert WatchdogDeathPenalty.handle_death_penalty is TimerDeathPenalty.handle_death_penalty
