"""The lease heartbeat (workers/lease.py): one thread renews every lease of the process, and is woken
only for a lease due before it would look again by itself. A real redis-server."""

from __future__ import annotations

import time

import redis
from mcp_saga.workers import lease as lease_module
from mcp_saga.workers.lease import Lease


def lease(r: redis.Redis, name: str, seconds: float) -> Lease:
    taken = Lease(r, f"test-lease:{name}", "w", seconds, workflow="wf", step=name)
    with r.pipeline(transaction=False) as pipe:
        taken.take(pipe)
        assert taken.taken(tuple(pipe.execute()))  # type: ignore[arg-type]
    return taken


def release(r: redis.Redis, held: Lease) -> None:
    with r.pipeline(transaction=False) as pipe:
        held.release(pipe)
        pipe.execute()


def test_a_lease_due_later_than_the_next_look_is_renewed_without_waking_the_thread(r: redis.Redis) -> None:
    keeper = lease_module._keeper
    first = lease(r, "first", 0.3)
    first.hold()  # starts the thread if this process had none
    release(r, first)
    deadline = time.monotonic() + 5
    while keeper._asleep_until == float("inf") or keeper._asleep_until - time.monotonic() < 0.5:
        assert time.monotonic() < deadline, "the heartbeat thread never went idle"
        time.sleep(0.01)  # idle: it looks again in a second
    keeper._wake.clear()
    slow = lease(r, "slow", 3.3)  # first renewal 1.1 s after it was taken: later than that look
    slow.hold()
    assert not keeper._wake.is_set()
    try:
        time.sleep(2.4)  # without a renewal 0.9 s would be left
        assert r.pttl(slow.key) > 1500, "the lease was not renewed"
        assert not slow.lost
    finally:
        release(r, slow)
    assert not r.exists(slow.key)


def test_a_lease_due_before_the_next_look_wakes_the_thread_and_is_renewed(r: redis.Redis) -> None:
    fast = lease(r, "fast", 0.45)
    fast.hold()
    try:
        time.sleep(1.0)  # two leases' worth
        assert r.exists(fast.key) and not fast.lost
    finally:
        release(r, fast)
