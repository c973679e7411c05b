"""Publishing the orchestrator's events onto `saga:events`, for agents that do not use the wrapper.

Every entry goes through the coordinator's own gate (`decode_entry`) before it is written, so a
bad id or an oversized result is refused here with a ValueError that names the field, and nothing
reaches the stream: a dead letter found later, after the agent has moved on, helps nobody.
`Publisher` (redis-py) and `AsyncPublisher` (redis.asyncio) share the builders and differ only in
how they await the one XADD each event costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from mcp_saga.runtime.durability import (
    TOPOLOGY_ERRORS,
    Durability,
    NotReplicated,
    Writes,
    node_client_async,
)
from mcp_saga.runtime.pipelined import Pipelined, xadd_args
from mcp_saga.schemas.events import (
    MAX_DATA_BYTES,
    TEXT_MAX,
    FailedStep,
    Payload,
    StepCompleted,
    StepStarted,
    TraceContext,
    WorkflowCompleted,
    WorkflowFailed,
    decode_entry,
    encode_payload,
)
from mcp_saga.schemas.expressions import (
    CUT_META_KEY,
    ExpressionError,
    UnresolvableError,
    keep_only,
    referenced_pointers,
    response_body,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.pointer import format_pointer
from mcp_saga.schemas.records import forward_key
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery
from pydantic import BaseModel
from redis.exceptions import RedisClusterException, RedisError, TryAgainError

if TYPE_CHECKING:
    import redis
    import redis.asyncio

log = logging.getLogger(__name__)
OnFailure = Literal["halt", "continue"]


_second: list[Any] = [None, ""]  # the last whole second formatted, and its text: strftime is most of the cost


def utc_now() -> str:
    """ISO 8601 with milliseconds: what an operator reading the stream with redis-cli can parse by eye."""
    t = time.time()
    second = int(t)
    if second != _second[0]:
        _second[:] = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return f"{_second[1]}.{int(t % 1 * 1000):03d}Z"


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


def fit_step(payload: StepCompleted) -> tuple[StepCompleted, str | None]:
    """The step as it can be recorded within the event cap, and what was left out (None: nothing).

    A tool result can be far larger than an event may be (a 1 MB report), but undoing the step
    needs only what its recovery binds. So an oversized step is cut, in this order, until it fits:
    the text mirror of `structuredContent` goes; then the result is cut to the pointers the
    recovery reads (`keep_only`); then the arguments too. What is left carries a marker under
    `_meta[CUT_META_KEY]`. If even the bound values do not fit, they go as well and the step is
    recorded without them: the coordinator finds the bindings unresolvable and the workflow's
    attention names the step, the tool and the cut, instead of a step nobody knows about.
    """
    try:
        size = len(encode_payload(payload))
    except TypeError:  # not JSON at all: `checked_entry` refuses it with the reason
        return payload, None
    if size <= MAX_DATA_BYTES:
        return payload, None
    result = payload.result
    where = f"step {payload.step!r} ({payload.server}:{payload.tool})"
    over = f"{where}: the call's record is {size} bytes, over the {MAX_DATA_BYTES}-byte cap of an event"
    marker: dict[str, Any] = {"bytes": size, "cap": MAX_DATA_BYTES, "tool": payload.tool, "complete": True}
    if result.get("structuredContent") is not None and "content" in result:
        marker["kept"] = ["structuredContent"]
        mirror_dropped = {k: v for k, v in result.items() if k != "content"}
        candidate = _with_marker(payload, mirror_dropped, payload.arguments, marker)
        if _fits(candidate):
            return candidate, f"{over}; recorded without the text mirror of its structuredContent"
    body, headers, inputs = _bound_pointers(payload.recovery)
    marker["kept"] = [f"$response.body#{format_pointer(t)}" for t in body] + [f"$response.header.{h}" for h in headers]
    marker["kept"] += [f"$request.body#{format_pointer(t)}" for t in inputs]
    cut: dict[str, Any] = {"isError": bool(result.get("isError", False))}
    meta = result.get("_meta")
    if isinstance(meta, dict):
        cut["_meta"] = {key: meta[key] for key in headers if key in meta}
    if body:  # a body that is unresolvable whole stays so cut; the coordinator says why when it plans
        with contextlib.suppress(UnresolvableError):
            cut["structuredContent"] = keep_only(response_body(result), body)
    kept = ", ".join(marker["kept"]) or "nothing"
    candidate = _with_marker(payload, cut, payload.arguments, marker)
    if _fits(candidate):
        return candidate, f"{over}; recorded with only what its recovery binds ({kept})"
    marker["argumentsCut"] = True
    candidate = _with_marker(payload, cut, keep_only(payload.arguments, inputs) or {}, marker)
    if _fits(candidate):
        return candidate, f"{over}; recorded with only what its recovery binds ({kept}), arguments included"
    marker.update(complete=False, kept=[])
    candidate = _with_marker(payload, {"isError": cut["isError"]}, {}, marker)
    return candidate, f"{over}; even what its recovery binds ({kept}) does not fit, so it cannot be undone"


def _bound_pointers(
    recovery: dict[str, Any] | None,
) -> tuple[list[tuple[str, ...]], list[str], list[tuple[str, ...]]]:
    """What a declaration reads: body pointers, `_meta` keys, argument pointers (none if invalid)."""
    try:
        operation = parse_recovery(recovery).compensating_operation if recovery is not None else None
        found = referenced_pointers(operation.parameters) if operation is not None else []
    except (RecoveryError, ExpressionError):
        found = []
    body = [tokens for _, kind, tokens in found if kind == "response.body"]
    headers = [tokens[0] for _, kind, tokens in found if kind == "response.header"]
    inputs = [tokens for _, kind, tokens in found if kind == "request.body"]
    return body, headers, inputs


def _with_marker(
    payload: StepCompleted, result: dict[str, Any], arguments: dict[str, Any], marker: dict[str, Any]
) -> StepCompleted:
    meta = {**(result.get("_meta") or {}), CUT_META_KEY: dict(marker)}
    return msgspec.structs.replace(payload, result={**result, "_meta": meta}, arguments=arguments)


def _fits(payload: StepCompleted) -> bool:
    return len(encode_payload(payload)) <= MAX_DATA_BYTES


def _fitted(payload: StepCompleted) -> StepCompleted:
    payload, cut = fit_step(payload)
    if cut is not None:
        log.warning(cut)
    return payload


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


def checked_entry(workflow: str, payload: Payload, data: bytes | None = None) -> dict[bytes, bytes]:
    """The stream entry for a payload (`data`: its encoding, when the caller has it already), or
    ValueError with the coordinator's own reason for refusing it."""
    if not isinstance(workflow, str):
        raise ValueError(f"workflow id must be a string, not {type(workflow).__name__}")
    fields = {b"type": payload.TYPE.encode(), b"workflow": workflow.encode(), b"data": data or _encode(payload)}
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
    """The checked entry of a step-completed; one over the size cap is cut down by `fit_step` to
    what its recovery binds, with a marker, and the cut is logged (the caller keeps its result)."""
    payload = step_completed(step, server, tool, arguments, result, recovery, annotations, trace=trace)
    encoded = _encode(payload)  # once: what fits is written as it is
    if len(encoded) <= MAX_DATA_BYTES:
        return checked_entry(workflow, payload, encoded)
    payload, cut = fit_step(payload)
    if cut is not None:
        log.warning("workflow %r: %s", workflow, cut)
    return checked_entry(workflow, payload)


def started_entry(
    workflow: str,
    step: str,
    server: str,
    tool: str,
    arguments: Mapping[str, Any] | None,
    recovery: Mapping[str, Any] | None = None,
    annotations: Mapping[str, Any] | None = None,
    trace: TraceContext | None = None,
    key: str | None = None,
) -> dict[bytes, bytes] | None:
    """The checked entry of a step-started, with the forward key of (workflow, step) unless `key` is given
    (a client's own idempotency key for the call, which the server will see).

    None when the intent is over the size cap: it is not cut as a step-completed is, because a
    recall must send exactly the arguments of the call, so such a call goes unannounced (the
    behaviour without intents) and the caller logs it.
    """
    payload = StepStarted(
        step=step,
        server=server,
        tool=tool,
        forward_key=key or forward_key(workflow, step),
        arguments=dict(arguments or {}),
        recovery=wire(recovery),
        annotations=dict(annotations) if annotations else None,
        started_at=utc_now(),
        trace=trace,
    )
    try:
        data: bytes | None = _encode(payload)
    except ValueError:
        data = None  # checked_entry says why
    if data is not None and len(data) > MAX_DATA_BYTES:
        return None
    return checked_entry(workflow, payload, data)


def _encode(payload: Payload) -> bytes:
    try:
        return encode_payload(payload)
    except TypeError as exc:  # e.g. an argument value JSON cannot carry
        raise ValueError(f"{payload.TYPE} data is not JSON-serialisable: {exc}") from None


# How long a publisher with durability re-sends an event that too few replicas confirmed (the
# remaining replica of a just-promoted primary is still syncing) before it gives up. A re-sent
# entry may be on the stream twice: the coordinator folds the copy to no change.
NOT_REPLICATED_RETRY_FOR = 5.0


def _resend_waits() -> Iterator[float]:
    """The waits before each re-send of an event too few replicas confirmed: 0.05 s doubling to 1 s,
    for NOT_REPLICATED_RETRY_FOR seconds, and at least one re-send however long the first send took."""
    deadline, delay = time.monotonic() + NOT_REPLICATED_RETRY_FOR, 0.05
    yield delay
    while time.monotonic() < deadline:
        delay = min(delay * 2, 1.0)
        yield delay


class _Base:
    """`partitions` must match the deployment's `[redis] partitions`: each event goes to the stream
    of its workflow's partition (`Keys.partition_of`, CLUSTER KEYSLOT mod the count).

    `durability` (from `[redis] wait_replicas`): each XADD is followed by WAIT in the same round
    trip; an event too few replicas confirmed is not acknowledged: it is sent again for a few
    seconds, then `NotReplicated` is raised and the caller's own handling of a failed write applies
    (the gateway's retries and refusal, the SDK's `StepNotRecorded`)."""

    def __init__(
        self, redis: Any, prefix: str = "saga", partitions: int = 1, *, durability: Durability | None = None
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix, partitions)
        self.durability = durability
        self._streams = [part.events for part in self.keys.every()]

    def stream_for(self, workflow: str) -> str:
        return self._streams[self.keys.partition_of(workflow)]


async def _retrying(error: Exception) -> None:
    """What redis-py's Retry calls between two tries: a repeated XADD is harmless, so nothing to undo."""


def _entry_id(reply: Any) -> str:
    return reply.decode() if isinstance(reply, bytes) else str(reply)


class Publisher(_Base):
    """Synchronous publisher over a `redis.Redis`; each method is one XADD and returns the entry id."""

    redis: redis.Redis

    def publish(self, workflow: str, payload: Payload) -> str:
        return self.add(workflow, checked_entry(workflow, payload), f"{payload.TYPE} of {workflow[:80]!r}")

    def add(self, workflow: str, entry: dict[bytes, bytes], what: str = "event") -> str:
        """XADD one checked entry of `workflow`; with durability, retried while too few replicas confirm it."""
        stream = self.stream_for(workflow)
        if self.durability is None:
            return _entry_id(self.redis.xadd(stream, entry))  # type: ignore[arg-type]
        waits = _resend_waits()
        while True:
            writes = Writes(self.redis, self.durability)
            writes.pipe(stream).xadd(stream, entry)
            try:
                [entry_id] = writes.execute(what)
                return _entry_id(entry_id)
            except (NotReplicated, TryAgainError):
                wait = next(waits, None)
                if wait is None:
                    raise
            time.sleep(wait)

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
        """Record a tool call that succeeded; `recovery` is what the tool declared (or an overlay), None if nothing.

        An oversized call is recorded cut down to what its recovery binds (`fit_step`), not refused.
        """
        payload = _fitted(step_completed(step, server, tool, arguments, result, recovery, annotations, completed_at))
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

    def __init__(
        self, *args: Any, pipe: Pipelined | None = None, retry: redis.asyncio.retry.Retry | None = None, **kwargs: Any
    ) -> None:
        """`pipe`: a pipelined connection to the same (standalone) Redis, which then carries every XADD
        (and its WAIT) at a fraction of redis-py's cost per command; `redis` keeps everything else.
        `retry`: how an XADD on `pipe` that met a lost connection or a timeout is sent again (redis-py's
        own clients retry by themselves; the pipe does not, and the gateway retries its writes itself)."""
        super().__init__(*args, **kwargs)
        self.pipe, self.retry = pipe, retry
        # On a cluster with durability, a client of each primary's own (node_client_async).
        self._nodes: dict[str, redis.asyncio.Redis] = {}

    async def publish(self, workflow: str, payload: Payload) -> str:
        return await self.add(workflow, checked_entry(workflow, payload), f"{payload.TYPE} of {workflow[:80]!r}")

    async def add(self, workflow: str, entry: dict[bytes, bytes], what: str = "event") -> str:
        stream = self.stream_for(workflow)
        if self.pipe is not None:
            pipe = self.pipe
            if self.retry is None:
                return await self._add_piped(pipe, stream, entry, what)
            return await self.retry.call_with_retry(lambda: self._add_piped(pipe, stream, entry, what), _retrying)
        if self.durability is None:
            return _entry_id(await self.redis.xadd(stream, entry))  # type: ignore[arg-type]
        waits = _resend_waits()
        while True:
            node = await node_client_async(self.redis, stream, self._nodes)
            pipe = node.pipeline(transaction=False)
            pipe.xadd(stream, entry)  # type: ignore[arg-type]
            self.durability.queue(pipe)
            try:
                entry_id, acknowledged = await pipe.execute()
                self.durability.check(acknowledged, what)
                return _entry_id(entry_id)
            except TOPOLOGY_ERRORS:  # a failover or resharding (see runtime/durability.py)
                if node is self.redis:
                    raise
                with contextlib.suppress(RedisError, RedisClusterException):  # no node answers yet: next time
                    await self.redis.nodes_manager.initialize()
                wait = next(waits, None)
                if wait is None:
                    raise
            except NotReplicated:
                wait = next(waits, None)
                if wait is None:
                    raise
            await asyncio.sleep(wait)

    async def _add_piped(self, pipe: Pipelined, stream: str, entry: dict[bytes, bytes], what: str) -> str:
        """The XADD on the pipelined connection; with durability its WAIT goes in the same write (WAIT
        covers the connection's earlier writes, this one included), re-sent as `add` does."""
        if self.durability is None:
            return _entry_id(await pipe.xadd(stream, entry))
        waits = _resend_waits()
        while True:
            commands = [xadd_args(stream, entry), ["WAIT", *self.durability.args]]
            entry_id, acknowledged = await pipe.execute_many(commands)
            try:
                self.durability.check(acknowledged, what)
                return _entry_id(entry_id)
            except NotReplicated:
                wait = next(waits, None)
                if wait is None:
                    raise
            await asyncio.sleep(wait)

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
        payload = _fitted(step_completed(step, server, tool, arguments, result, recovery, annotations, completed_at))
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
