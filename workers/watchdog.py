"""RQ's job timeout for the worker's slot threads, kept by one long-lived thread instead of a thread per job.

A slot thread cannot use SIGALRM (only the main thread gets signals), so RQ's answer is its
`TimerDeathPenalty`: a `threading.Timer` started for every job and cancelled at its end. That is a
new OS thread per compensation, and a profile of the worker counted `Thread.start` at about 2% of
its samples. `WatchdogDeathPenalty` is a `TimerDeathPenalty` (RQ's public `death_penalty_class`
extension point) whose deadline goes into a heap that one watchdog thread per process keeps; when one
passes, the watchdog raises in the job's thread with RQ's own `handle_death_penalty` (the same
exception, message and `PyThreadState_SetAsyncExc`; the message is set per timeout, not per
process). A job that ends first only marks its entry, so the common case is a heap push and a flag
under one lock, and no thread is started or woken.
"""

from __future__ import annotations

import functools
import heapq
import os
import threading
import time
from dataclasses import dataclass, field

from mcp_saga.runtime.logs import get_logger
from rq.timeouts import BaseDeathPenalty, JobTimeoutException, TimerDeathPenalty

log = get_logger("worker")
# Cancelled entries are dropped from the heap once they are this many and over half of it: a heap of
# deadlines mostly minutes away would otherwise grow by one entry a job until the first of them passes.
COMPACT_AFTER = 64


@dataclass(order=True, slots=True)
class _Deadline:
    when: float
    seq: int
    penalty: TimerDeathPenalty | None = field(compare=False)


class _Watchdog:
    """The heap of the process's armed job deadlines and the one thread that enforces them."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start empty (also in a forked child, which has none of the parent's threads and none of its jobs)."""
        self._lock = threading.Condition()
        self._heap: list[_Deadline] = []
        self._cancelled = 0
        self._seq = 0
        self._thread: threading.Thread | None = None

    def arm(self, penalty: TimerDeathPenalty, timeout: float) -> _Deadline:
        with self._lock:
            self._seq += 1
            deadline = _Deadline(time.monotonic() + timeout, self._seq, penalty)
            heapq.heappush(self._heap, deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rq-job-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0] is deadline:  # sooner than what the watchdog sleeps until
                self._lock.notify()
            return deadline

    def disarm(self, deadline: _Deadline) -> None:
        """After this returns the watchdog raises nothing more for the deadline (it fires under the same lock)."""
        with self._lock:
            if deadline.penalty is None:
                return
            deadline.penalty = None
            self._cancelled += 1
            if self._cancelled > COMPACT_AFTER and self._cancelled * 2 > len(self._heap):
                self._heap = [armed for armed in self._heap if armed.penalty is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def armed(self) -> int:
        with self._lock:
            return len(self._heap) - self._cancelled

    def _run(self) -> None:
        with self._lock:
            while True:
                heap = self._heap
                while heap and heap[0].penalty is None:
                    heapq.heappop(heap)
                    self._cancelled -= 1
                if not heap:
                    self._lock.wait()
                    continue
                wait = heap[0].when - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                deadline = heapq.heappop(heap)
                penalty, deadline.penalty = deadline.penalty, None
                assert penalty is not None
                try:
                    penalty.handle_death_penalty()
                except (ValueError, SystemError) as exc:  # the job's thread is gone: nothing left to stop
                    log.warning("job timeout not delivered", error=str(exc))


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)


@functools.cache
def _with_message(exception: type[BaseException], timeout: float) -> type[BaseException]:
    """`exception` raised with RQ's message for `timeout` (the delivery takes a class, not an instance).

    RQ's `TimerDeathPenalty` sets the message by replacing `exception.__init__` for every job, so with
    two timeouts in one process a job could be told the other's; a subclass per timeout cannot. It keeps
    the name and module, so what RQ writes in the failed job's traceback reads the same."""

    def __init__(self: BaseException, *args: object) -> None:
        super(subclass, self).__init__(f"Task exceeded maximum timeout value ({timeout} seconds)")

    subclass = type(exception.__name__, (exception,), {"__init__": __init__})
    subclass.__module__, subclass.__qualname__ = exception.__module__, exception.__qualname__
    return subclass


class WatchdogDeathPenalty(TimerDeathPenalty):
    """RQ's `TimerDeathPenalty` (same exception, message and delivery) with the process's one watchdog thread."""

    _deadline: _Deadline | None = None

    def __init__(self, timeout: float, exception: type[BaseException] = JobTimeoutException, **kwargs: object):
        BaseDeathPenalty.__init__(self, timeout, _with_message(exception, timeout), **kwargs)
        self._target_thread_id = threading.current_thread().ident
        self._timer = None

    def setup_death_penalty(self) -> None:
        if self._timeout <= 0:
            return
        self._deadline = _WATCHDOG.arm(self, self._timeout)

    def cancel_death_penalty(self) -> None:
        if self._deadline is not None:
            _WATCHDOG.disarm(self._deadline)
            self._deadline = None
