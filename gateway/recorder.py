"""What the gateway writes to `saga:events`, in order, and what it does when it cannot.

Each workflow's events go out one after another (a chain of tasks), so the stream holds its steps
in completion order. A step-completed is queued when the upstream answers and built and written
once the client has its answer (the entry, its checks and the XADD are off the call's path). An
XADD that fails is retried with backoff for `publish_retry_for` seconds; the workflow's next call
waits for its earlier steps to be written before it goes out, and a step still unwritten then
poisons its workflow: every later call of it is refused, because forwarding calls whose trail is
broken would let the agent pile up effects nobody can undo. While Redis does not answer at all,
new calls of every workflow are refused before they are forwarded.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from mcp_saga.runtime.durability import Durability
from mcp_saga.runtime.logs import get_logger
from mcp_saga.runtime.pipelined import Pipelined, xadd_args
from mcp_saga.runtime.publish import AsyncPublisher, workflow_failed
from mcp_saga.schemas.events import WorkflowCompleted

log = get_logger("gateway")

# A health probe shorter than the agent's patience: a refused call comes back in about this long.
PING_TIMEOUT = 1.0


Entry = dict[bytes, bytes]


class NotRecordable(Exception):
    """A call the gateway will not forward, because it could not record it; the message says why."""


@dataclass
class _Workflow:
    steps: int = 0
    ended: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    tail: asyncio.Future[None] | None = None  # settled once the workflow's last queued event is written (or lost)
    lost: str | None = None  # the step that could not be written, and why


class Recorder:
    """The gateway's one writer: per-workflow order, retries, and the refusal rule."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str = "saga",
        *,
        retry_for: float = 10.0,
        partitions: int = 1,
        durability: Durability | None = None,
        pipe: Pipelined | None = None,
    ) -> None:
        """`pipe`: the pipelined connection the events go over (runtime/pipelined.py), when the Redis is
        one it can serve; `redis` then only answers what `pipe` does not carry."""
        self.publisher = AsyncPublisher(redis, prefix, partitions, durability=durability, pipe=pipe)
        self._pipe = pipe
        self._writer: Any = pipe if pipe is not None else redis
        self.retry_for = retry_for
        self.workflows: dict[str, _Workflow] = {}
        self._healthy = True

    def _state(self, workflow: str) -> _Workflow:
        state = self.workflows.get(workflow)
        if state is None:
            state = self.workflows[workflow] = _Workflow()
        return state

    async def admit(self, workflow: str) -> None:
        """Raise `NotRecordable` for a call that must not be forwarded; otherwise note the workflow as active.

        A call waits for the workflow's earlier steps to be written (they are retried for up to
        `retry_for`): one that could not be is known before this call goes out, not after.
        """
        state = self._state(workflow)
        state.last_seen = time.monotonic()
        self._check_lost(workflow, state)
        if not self._healthy and not await self.ping():
            raise NotRecordable(
                "Redis is unreachable, so the gateway could not record this call; it was not forwarded (retry later)"
            )
        if state.tail is not None and not state.tail.done():
            await asyncio.wait([state.tail])
            self._check_lost(workflow, state)

    @staticmethod
    def _check_lost(workflow: str, state: _Workflow) -> None:
        if state.lost is not None:
            raise NotRecordable(
                f"workflow {workflow!r} has a step the gateway could not record ({state.lost}); "
                "refusing further calls of it: signal the failure, and check it with `saga inspect`"
            )

    async def ping(self) -> bool:
        try:
            await asyncio.wait_for(self._writer.ping(), PING_TIMEOUT)
        except Exception:
            self._healthy = False
            return False
        self._healthy = True
        return True

    async def started(self, workflow: str, step: str, fields: dict[bytes, bytes] | None) -> None:
        """Write a call's intent (step-started) and wait for Redis to acknowledge it, before the call is forwarded.

        Raises `NotRecordable` when it cannot be written: a call the coordinator would not know about
        is not forwarded. `None` (an intent over the event cap) writes nothing: the call goes
        unannounced, as without intents. Not chained behind the workflow's earlier step-completed
        writes: the intent's own stream position is the step's place on the stack.
        """
        if fields is None:
            log.warning("intent over the event cap; the call goes unannounced", workflow=workflow, step=step)
            return
        try:  # the publisher's add: with `[redis] wait_replicas`, an intent counts only once replicas confirm it
            await self.publisher.add(workflow, fields, f"intent of step {step!r} of {workflow!r}")
        except Exception as exc:
            self._healthy = False
            raise NotRecordable(
                f"the gateway could not record the intent of this call ({type(exc).__name__}); it was not forwarded"
            ) from exc
        self._healthy = True

    def completed(
        self,
        workflow: str,
        step: str,
        fields: Entry | Callable[[], Entry],
        *,
        failed: bool = False,
        after: asyncio.Future[None] | None = None,
    ) -> None:
        """The call answered: its step-completed settles the intent (queued like any step). `failed`: an
        `isError` answer, which settles the intent but is no completed step for `stepsCompleted`."""
        self.step(workflow, step, fields, counted=not failed, after=after)

    def step(
        self,
        workflow: str,
        step: str,
        fields: Entry | Callable[[], Entry],
        *,
        counted: bool = True,
        after: asyncio.Future[None] | None = None,
    ) -> None:
        """Queue a step-completed behind the workflow's earlier events: its checked entry, or the function
        that builds it, called when its turn comes and `after` is done (the client has the answer). One
        whose entry cannot be built (`ValueError`: it cannot be recorded at all) poisons the workflow."""
        state = self._state(workflow)
        state.steps += counted
        previous = state.tail
        if self._pipe is None or self.publisher.durability is not None or not (previous is None or previous.done()):
            state.tail = asyncio.create_task(self._write(workflow, step, fields, previous, after))
            return
        # Nothing of the workflow's is in flight: no task, the write goes out from a callback once `after` is done
        # (its reply settles `tail`), and only a failed write starts the retrying task.
        state.tail = tail = asyncio.get_running_loop().create_future()
        if after is None or after.done():
            self._write_now(workflow, step, fields, tail)
        else:
            after.add_done_callback(lambda _: self._write_now(workflow, step, fields, tail))

    def _write_now(
        self, workflow: str, step: str, fields: Entry | Callable[[], Entry], tail: asyncio.Future[None]
    ) -> None:
        assert self._pipe is not None
        try:
            entry = fields() if callable(fields) else fields
        except Exception as exc:  # a callback's error would reach nobody: the step is lost, and says why
            self._unbuildable(workflow, step, exc)
            tail.set_result(None)
            return
        sent = self._pipe.send_now(*xadd_args(self.publisher.stream_for(workflow), entry))

        def retry() -> None:
            task = asyncio.create_task(self._write(workflow, step, entry, None, None))
            task.add_done_callback(lambda _: tail.set_result(None))

        def replied(reply: asyncio.Future[Any]) -> None:
            error = reply.exception() if not reply.cancelled() else asyncio.CancelledError()
            if error is None:
                self._healthy = True
                tail.set_result(None)
            else:
                log.warning("step not written yet; retrying", workflow=workflow, step=step, error=repr(error))
                retry()

        if sent is None:  # not connected: the task connects (and retries)
            retry()
        else:
            sent.add_done_callback(replied)

    def _unbuildable(self, workflow: str, step: str, exc: Exception) -> None:
        self._state(workflow).lost = f"step {step!r}: {exc}"
        log.error("step not recordable", workflow=workflow, step=step, error=str(exc))

    async def _write(
        self,
        workflow: str,
        step: str,
        fields: Entry | Callable[[], Entry],
        previous: Any,
        after: asyncio.Future[None] | None,
    ) -> None:
        waits = [task for task in (previous, after) if task is not None]
        if waits:
            await asyncio.wait(waits)
        if callable(fields):
            try:
                fields = fields()
            except ValueError as exc:
                self._unbuildable(workflow, step, exc)
                return
        deadline, delay = time.monotonic() + self.retry_for, 0.05
        while True:
            try:
                await self.publisher.add(workflow, fields, f"step {step!r} of {workflow!r}")
                self._healthy = True
                return
            except Exception as exc:
                self._healthy = False
                if time.monotonic() >= deadline:
                    self._state(workflow).lost = f"step {step!r}: {type(exc).__name__}: {exc}"
                    log.error("step not recorded", workflow=workflow, step=step, error=repr(exc))
                    return
                log.warning("step not written yet; retrying", workflow=workflow, step=step, error=repr(exc))
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())) * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)

    async def flush(self, workflow: str) -> None:
        state = self.workflows.get(workflow)
        if state is not None and state.tail is not None:
            await asyncio.wait([state.tail])

    async def fail(self, workflow: str, reason: str) -> str:
        """workflow-failed after every step of it this gateway handled, which `stepsCompleted` counts."""
        state = self._state(workflow)
        await self.flush(workflow)
        entry = await self.publisher.publish(workflow, workflow_failed(reason, steps_completed=state.steps))
        state.ended = True
        return entry

    async def complete(self, workflow: str) -> str:
        await self.flush(workflow)
        entry = await self.publisher.publish(workflow, WorkflowCompleted())
        self._state(workflow).ended = True
        return entry

    async def apply_policy(self, workflow: str, policy: str, why: str) -> None:
        """End a workflow nobody ended, as the config says (`leave` publishes nothing)."""
        state = self.workflows.get(workflow)
        if state is None or state.ended or policy == "leave":
            return
        try:
            if policy == "fail":
                await self.fail(workflow, f"{why} without a signal (gateway policy: fail)")
            else:
                await self.complete(workflow)
        except Exception as exc:
            log.error("session policy could not be applied", workflow=workflow, policy=policy, error=repr(exc))
            return
        log.info("session policy applied", workflow=workflow, policy=policy, why=why)

    async def watch_health(self, every: float = 0.5) -> None:
        """Keep the health flag current, so a Redis outage refuses calls before any write has failed."""
        while True:
            await self.ping()
            await asyncio.sleep(every)

    def idle(self, older_than: float) -> list[str]:
        """Workflows without a call for `older_than` seconds, ended or not: the sweeper's to settle and forget."""
        cutoff = time.monotonic() - older_than
        return [wf for wf, state in self.workflows.items() if state.last_seen < cutoff]

    def forget(self, workflow: str) -> None:
        """Drop what the gateway holds for a workflow, except one that must keep refusing calls."""
        state = self.workflows.get(workflow)
        if state is not None and (state.tail is None or state.tail.done()) and state.lost is None:
            del self.workflows[workflow]
