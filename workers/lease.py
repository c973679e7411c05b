"""A worker's lease on one compensation, held and refreshed for as long as the worker is on it.

The lease key (`Keys.lease(wf, step)`) is half of the coordinator's definition of a *silent*
compensation: one with no attempt report of its current dispatch for `watchdog_after` seconds and
no lease. So a live worker must never let its lease lapse in the middle of a slow call, and a dead
one must lose it soon: the lease is taken for `[worker] lease` seconds and a heartbeat thread
extends it every third of that while the attempt runs (one thread per process renews them all).
A worker that dies (or is stopped) stops renewing, and its lease is gone within `lease` seconds;
the watchdog may then re-dispatch.

Renewing checks the token, so a worker that stalled past its lease (SIGSTOP, a long GC pause)
and came back cannot take the lease back from the worker that has it now; it logs that it lost it.
"""

from __future__ import annotations

import threading
import time
import uuid
from importlib import resources

from mcp_saga.runtime.connect import evaluate
from mcp_saga.runtime.logs import get_logger
from redis import Redis
from redis.client import Pipeline
from redis.exceptions import RedisError

log = get_logger("worker")


def _script(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text()


RELEASE = _script("release.lua")
RENEW = _script("renew.lua")


class _Keeper:
    """One heartbeat thread per process renews every lease the process holds, in one pipeline.

    A thread per attempt cost a start and a join on every job; this costs one round trip per beat
    whatever the number of slots.
    """

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # When the thread will look again by itself: a lease due later needs no wake-up, which would
        # cost the attempt that holds it a GIL hand-over just before its call.
        self._asleep_until = float("inf")

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.token] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)
                self._thread.start()
            early = lease.renew_at < self._asleep_until
        if early:  # asleep until a later renewal than this lease's first
            self._wake.set()

    def remove(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.token, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                leases = list(self._leases.values())
            due = [lease for lease in leases if time.monotonic() >= lease.renew_at]
            if due:
                self._renew(due)
            with self._lock:
                pending = [lease.renew_at for lease in self._leases.values()]
                wait = max(0.01, min(pending) - time.monotonic()) if pending else 1.0
                self._asleep_until = time.monotonic() + wait
            self._wake.wait(wait)
            with self._lock:
                self._asleep_until = float("inf")  # awake: a lease added now is seen by the next look
            self._wake.clear()

    def _renew(self, due: list[Lease]) -> None:
        redis = due[0].redis
        try:
            with redis.pipeline(transaction=False) as pipe:
                for lease in due:
                    evaluate(pipe, RENEW, [lease.key], [lease.token, lease.ms])
                kept = pipe.execute()
        except RedisError as exc:  # a Redis blip: each lease still has two thirds left, try again soon
            log.warning("lease renewal failed", leases=len(due), error=str(exc))
            for lease in due:
                lease.renew_at = time.monotonic() + min(1.0, lease.every)
            return
        for lease, ok in zip(due, kept, strict=True):
            lease.renew_at = time.monotonic() + lease.every
            with self._lock:
                held = lease.token in self._leases  # released meanwhile: its key is gone, as it should be
            if not ok and held:
                lease.lost = True
                self.remove(lease)
                log.warning(
                    "lease lost while the call is in flight: another worker may run this compensation too"
                    " (the idempotency key keeps the effect once)",
                    workflow=lease.workflow,
                    step=lease.step,
                )


_keeper = _Keeper()


class Lease:
    """One attempt's hold on a compensation; `take` and `release` ride in the caller's pipeline."""

    def __init__(
        self, redis: Redis, key: str, holder: str, seconds: float, *, workflow: str, step: str, token: str | None = None
    ) -> None:
        self.redis, self.key = redis, key
        # A deferred job's continuation adopts the token its deferral parked the lease under.
        self.token = token or f"{holder}:{uuid.uuid4().hex}"
        self.ms = max(1, int(seconds * 1000))
        self.every = seconds / 3
        self.workflow, self.step = workflow, step
        self.lost = False
        self.renew_at = 0.0

    def take(self, pipe: Pipeline) -> None:
        """Queue SET NX and a GET of the holder: (taken, holder) come back from `pipe.execute()`."""
        pipe.set(self.key, self.token, nx=True, px=self.ms)
        pipe.get(self.key)

    def taken(self, reply: tuple[object, object]) -> bool:
        """Whether the lease is ours, from `take`'s two replies (set, or already held under our token)."""
        done, holder = reply
        return bool(done) or (holder.decode() if isinstance(holder, bytes) else holder) == self.token

    def park(self, seconds: float) -> bool:
        """Hold the lease for `seconds` with no heartbeat: a deferred job's continuation is due by then.

        Keeps the compensation from looking silent while it waits; False when another worker holds
        the lease (then nothing is parked, and the continuation will find it held, as any job would).
        """
        return park_all([self], seconds)[0]

    def hold(self) -> None:
        """Keep the lease alive: the first renewal comes a third of a lease after it was taken."""
        self.renew_at = time.monotonic() + self.every
        _keeper.add(self)

    def release(self, pipe: Pipeline) -> None:
        """Stop renewing and queue the release (a no-op when the lease is no longer ours)."""
        _keeper.remove(self)
        evaluate(pipe, RELEASE, [self.key], [self.token])  # EVALSHA would add a SCRIPT EXISTS trip


def park_all(leases: list[Lease], seconds: float) -> list[bool]:
    """`Lease.park` for several leases in one round trip (a routing slip's steps)."""
    if not leases:
        return []
    with leases[0].redis.pipeline(transaction=False) as pipe:
        queue_park(pipe, leases, seconds)
        return parked(pipe.execute())


def queue_park(pipe: Pipeline, leases: list[Lease], seconds: float) -> None:
    """Queue `park_all`'s commands into a pipeline of the caller's (a job's first round trip)."""
    ms = max(1, int(seconds * 1000))
    for lease in leases:
        evaluate(pipe, RENEW, [lease.key], [lease.token, ms])
        pipe.set(lease.key, lease.token, nx=True, px=ms)


def parked(replies: list[object]) -> list[bool]:
    """Which leases `queue_park` parked, from its replies (ours renewed, or free and taken)."""
    return [bool(replies[2 * n] or replies[2 * n + 1]) for n in range(len(replies) // 2)]


def release_all(leases: list[Lease]) -> None:
    """Release several leases in one round trip (the steps of a slip that stopped before them)."""
    if not leases:
        return
    with leases[0].redis.pipeline(transaction=False) as pipe:
        for lease in leases:
            lease.release(pipe)
        pipe.execute()
