"""A worker's lease on one compensation, held and refreshed for as long as the worker is on it.

The lease key (`Keys.lease(wf, step)`) is half of the coordinator's definition of a *silent*
compensation: one with no attempt report of its current dispatch for `watchdog_after` seconds and
no lease. So a live worker must never let its lease lapse in the middle of a slow call, and a dead
one must lose it soon: the lease is taken for `[worker] lease` seconds and a heartbeat thread
extends it every third of that while the attempt runs. A worker that dies (or is stopped) stops
renewing, and its lease is gone within `lease` seconds; the watchdog may then re-dispatch.

Renewing checks the token, so a worker that stalled past its lease (SIGSTOP, a long GC pause)
and came back cannot take the lease back from the worker that has it now; it logs that it lost it.
"""

from __future__ import annotations

import threading
import uuid
from importlib import resources

from mcp_saga.runtime.logs import get_logger
from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

log = get_logger("worker")


def _script(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text()


RELEASE = _script("release.lua")
RENEW = _script("renew.lua")


class Lease:
    """One attempt's hold on a compensation; `take` and `release` ride in the caller's pipeline."""

    def __init__(self, redis: Redis, key: str, holder: str, seconds: float, *, workflow: str, step: str) -> None:
        self.redis, self.key = redis, key
        self.token = f"{holder}:{uuid.uuid4().hex}"
        self.ms = max(1, int(seconds * 1000))
        self.every = seconds / 3
        self.workflow, self.step = workflow, step
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, pipe: Pipeline) -> None:
        """Queue SET NX and a GET of the holder: (taken, holder) come back from `pipe.execute()`."""
        pipe.set(self.key, self.token, nx=True, px=self.ms)
        pipe.get(self.key)

    def hold(self) -> None:
        """Start the heartbeat; the first renewal comes a third of a lease after the lease was taken."""
        self._thread = threading.Thread(target=self._beat, name=f"lease:{self.key}", daemon=True)
        self._thread.start()

    def release(self, pipe: Pipeline) -> None:
        """Stop the heartbeat and queue the release (a no-op when the lease is no longer ours)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        pipe.eval(RELEASE, 1, self.key, self.token)  # EVALSHA would add a SCRIPT EXISTS trip

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                kept = self.redis.eval(RENEW, 1, self.key, self.token, self.ms)
            except RedisError as exc:  # a Redis blip: the lease still has two thirds left, try again
                log.warning("lease renewal failed", workflow=self.workflow, step=self.step, error=str(exc))
                continue
            if not kept:
                self.lost = True
                log.warning(
                    "lease lost while the call is in flight: another worker may run this compensation too"
                    " (the idempotency key keeps the effect once)",
                    workflow=self.workflow,
                    step=self.step,
                )
                return
