"""Publishing the orchestrator's events onto `saga:events`, for agents that do not use the wrapper.

Every entry goes through the coordinator's own gate (`decode_entry`) before it is written, so a
bad id or an oversized result is refused here with a ValueError that names the field, and nothing
reaches the stream: a dead letter found later, after the agent has moved on, helps nobody.
`Publisher` (redis-py) and `AsyncPublisher` (redis.asyncio) share the builders and differ only in
how they await the one XADD each event costs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from mcp_saga.schemas.events import (
    MAX_DATA_BYTES,
    TEXT_MAX,
    FailedStep,
    Payload,
    StepCompleted,
    TraceContext,
    WorkflowCompleted,
    WorkflowFailed,
    decode_entry,
    encode_payload,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.recovery import Recovery
from pydantic import BaseModel

if TYPE_CHECKING:
    import redis
    import redis.asyncio

OnFailure = Literal["halt", "continue"]


def utc_now() -> str:
    """ISO 8601 with milliseconds: what an operator reading the stream with redis-cli can parse by eye."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def clip(text: str, limit: int = TEXT_MAX) -> str:
    """Free text cut to the contract's cap with a marker: a long reason is shortened, never refused."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def wire(value: Any) -> Any:
    """Pydantic models (a `CallToolResult`, a `Recovery`) in their camelCase wire form; anything else as is."""
    if isinstance(value, Recovery):
        return value.to_wire()
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, mode="json", exclude_none=True)
    return value


def step_completed(
    step: str,
    server: str,
    tool: str,
    arguments: Mapping[str, Any] | None,
    result: Any,
    recovery: Recovery | Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
    completed_at: str | float | None = None,
    trace: TraceContext | None = None,
) -> StepCompleted:
    return StepCompleted(
        step=step,
        server=server,
        tool=tool,
        arguments=dict(arguments or {}),
        result=wire(result),
        recovery=wire(recovery),
        annotations=dict(annotations) if annotations else None,
        completed_at=utc_now() if completed_at is None else completed_at,
        trace=trace,
    )


def workflow_failed(
    reason: str = "",
    failed_step: FailedStep | Mapping[str, Any] | None = None,
    steps_completed: int | None = None,
    parallel: bool | None = None,
    on_failure: OnFailure | None = None,
    trace: TraceContext | None = None,
) -> WorkflowFailed:
    if isinstance(failed_step, Mapping):
        error = failed_step.get("error")
        failed_step = FailedStep(tool=failed_step.get("tool"), error=None if error is None else clip(str(error)))
    return WorkflowFailed(
        reason=clip(reason),
        failed_step=failed_step,
        steps_completed=steps_completed,
        parallel=parallel,
        on_failure=on_failure,
        trace=trace,
    )


def checked_entry(workflow: str, payload: Payload) -> dict[bytes, bytes]:
    """The stream entry for a payload, or ValueError with the coordinator's own reason for refusing it."""
    if not isinstance(workflow, str):
        raise ValueError(f"workflow id must be a string, not {type(workflow).__name__}")
    fields = {b"type": payload.TYPE.encode(), b"workflow": workflow.encode(), b"data": _encode(payload)}
    try:
        decode_entry("0-0", fields, strict=True)
    except ValueError as exc:
        raise ValueError(f"refusing to publish {payload.TYPE} for {workflow[:80]!r}: {exc}") from None
    return fields


def step_entry(
    workflow: str,
    step: str,
    server: str,
    tool: str,
    arguments: Mapping[str, Any] | None,
    result: dict[str, Any],
    recovery: Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
    trace: TraceContext | None = None,
) -> dict[bytes, bytes]:
    """The checked entry of a step-completed, without the text mirror of `structuredContent` if that
    is what puts it over the size cap (bindings read `structuredContent`); ValueError if still too big."""
    payload = step_completed(step, server, tool, arguments, result, recovery, annotations, trace=trace)
    try:
        return checked_entry(workflow, payload)
    except ValueError:
        oversize = len(encode_payload(payload)) > MAX_DATA_BYTES
        if not oversize or "structuredContent" not in result or "content" not in result:
            raise
        lean = {k: v for k, v in result.items() if k != "content"}
        lean_payload = step_completed(step, server, tool, arguments, lean, recovery, annotations, trace=trace)
        return checked_entry(workflow, lean_payload)


def _encode(payload: Payload) -> bytes:
    try:
        return encode_payload(payload)
    except TypeError as exc:  # e.g. an argument value JSON cannot carry
        raise ValueError(f"{payload.TYPE} data is not JSON-serialisable: {exc}") from None


class _Base:
    def __init__(self, redis: Any, prefix: str = "saga") -> None:
        self.redis = redis
        self.stream = Keys(prefix).events


class Publisher(_Base):
    """Synchronous publisher over a `redis.Redis`; each method is one XADD and returns the entry id."""

    redis: redis.Redis

    def publish(self, workflow: str, payload: Payload) -> str:
        entry_id = self.redis.xadd(self.stream, checked_entry(workflow, payload))  # type: ignore[arg-type]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    def step_completed(
        self,
        workflow: str,
        step: str,
        server: str,
        tool: str,
        arguments: Mapping[str, Any] | None,
        result: Any,
        recovery: Recovery | Mapping[str, Any] | None = None,
        annotations: Mapping[str, Any] | None = None,
        completed_at: str | float | None = None,
    ) -> str:
        """Record a tool call that succeeded; `recovery` is what the tool declared (or an overlay), None if nothing."""
        payload = step_completed(step, server, tool, arguments, result, recovery, annotations, completed_at)
        return self.publish(workflow, payload)

    def workflow_failed(
        self,
        workflow: str,
        reason: str = "",
        failed_step: FailedStep | Mapping[str, Any] | None = None,
        steps_completed: int | None = None,
        parallel: bool | None = None,
        on_failure: OnFailure | None = None,
    ) -> str:
        """Ask for the unwind; `steps_completed` lets the coordinator wait for step events still in flight."""
        return self.publish(workflow, workflow_failed(reason, failed_step, steps_completed, parallel, on_failure))

    def workflow_completed(self, workflow: str) -> str:
        return self.publish(workflow, WorkflowCompleted())


class AsyncPublisher(_Base):
    """The same over `redis.asyncio.Redis`, so an agent's event loop never blocks on Redis."""

    redis: redis.asyncio.Redis

    async def publish(self, workflow: str, payload: Payload) -> str:
        entry_id = await self.redis.xadd(self.stream, checked_entry(workflow, payload))  # type: ignore[arg-type]
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def step_completed(
        self,
        workflow: str,
        step: str,
        server: str,
        tool: str,
        arguments: Mapping[str, Any] | None,
        result: Any,
        recovery: Recovery | Mapping[str, Any] | None = None,
        annotations: Mapping[str, Any] | None = None,
        completed_at: str | float | None = None,
    ) -> str:
        payload = step_completed(step, server, tool, arguments, result, recovery, annotations, completed_at)
        return await self.publish(workflow, payload)

    async def workflow_failed(
        self,
        workflow: str,
        reason: str = "",
        failed_step: FailedStep | Mapping[str, Any] | None = None,
        steps_completed: int | None = None,
        parallel: bool | None = None,
        on_failure: OnFailure | None = None,
    ) -> str:
        return await self.publish(workflow, workflow_failed(reason, failed_step, steps_completed, parallel, on_failure))

    async def workflow_completed(self, workflow: str) -> str:
        return await self.publish(workflow, WorkflowCompleted())
