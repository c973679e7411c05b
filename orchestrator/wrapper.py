"""`async with mcp_saga.workflow(...) as wf`: MCP tool calls that leave a compensable trail on `saga:events`.

Each successful call costs one XADD on an async connection, handed to a task as soon as the tool
has answered (it goes out at the agent's next await) and confirmed in the background: its round
trip overlaps what the agent does next instead of delaying the call. On a CPU-contended 2-core
box an awaited XADD made a 2 ms tool 20-30% slower; this way it measured 4-11% (`bench/publisher.py`).
Entries stay in completion order, the terminal event is written only after every step's, a write
known to have failed refuses the next call before its tool runs, and `wf.flush()` confirms on
demand. The tool's recovery comes from a `tools/list` read once per session and overlapped with
the first call, so it adds no round trip either.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, get_args

import redis.asyncio as aioredis
from mcp_saga.runtime import tracing
from mcp_saga.runtime.connect import connect_async
from mcp_saga.runtime.durability import Durability
from mcp_saga.runtime.pipelined import shared_pipelined
from mcp_saga.runtime.publish import AsyncPublisher, OnFailure, clip, started_entry, step_entry, workflow_failed
from mcp_saga.runtime.recovery_wire import IDEMPOTENCY_META_KEY, ToolDeclaration, read_tool_declarations
from mcp_saga.runtime.sentinel import is_sentinel_url, parse_sentinel_url, sentinel_url
from mcp_saga.schemas.config import RedisSettings
from mcp_saga.schemas.events import (
    FailedStep,
    TraceContext,
    WorkflowCompleted,
    check_step_id,
    check_workflow_id,
)
from mcp_saga.schemas.records import forward_key
from mcp_saga.schemas.results import result_text as _text_of
from redis import Redis as SyncRedis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

if TYPE_CHECKING:
    from mcp import Client
    from mcp_saga.schemas.config import Config
    from mcp_types import CallToolResult

log = logging.getLogger(__name__)
_NOT_STEP_CHARS = re.compile(r"[^A-Za-z0-9._:-]")

# One listing per live session, shared by every workflow that uses it: agents open clients once and
# run many workflows. Keyed by the session (a `Client` is an unhashable dataclass), so reconnecting
# lists again.
_listings: weakref.WeakKeyDictionary[Any, asyncio.Future[dict[str, ToolDeclaration]]] = weakref.WeakKeyDictionary()


def _session(client: Any) -> Any:
    return client if hasattr(client, "send_request") else client.session


def forget_declarations(client: Any) -> None:
    """Drop a client's cached `tools/list`, e.g. after the server announced `tools/list_changed`."""
    _listings.pop(_session(client), None)


def _declarations(client: Any) -> asyncio.Future[dict[str, ToolDeclaration]]:
    session = _session(client)
    listing = _listings.get(session)
    if listing is None or (listing.done() and (listing.cancelled() or listing.exception() is not None)):
        listing = _listings[session] = asyncio.ensure_future(read_tool_declarations(session))
        # Retrieve a failure even when the call that started the listing failed first (no stray warning).
        listing.add_done_callback(lambda f: f.cancelled() or f.exception())
    return listing


def result_text(result: CallToolResult) -> str:
    """What a failed call said, for the exception and `failedStep.error`."""
    return _text_of(result) or "the tool reported an error (isError: true) without a message"


class ToolCallFailed(Exception):
    """A tool answered `isError: true`: not a completed step, and (unless caught) a failed workflow."""

    def __init__(self, server: str, tool: str, step: str, result: CallToolResult) -> None:
        self.server, self.tool, self.step, self.result = server, tool, step, result
        super().__init__(f"{server}:{tool} (step {step}) failed: {result_text(result)}")


class StepNotRecorded(RuntimeError):
    """A step's tool call succeeded but its event never reached Redis; later calls are refused."""


class Workflow:
    """One saga: enter it, `await wf.call(server, tool, arguments)`, and let the block's outcome speak.

    Leaving the block by an exception publishes `workflow-failed` (reason, `failedStep` when a tool
    call caused it, `stepsCompleted`, and `parallel`/`onFailure` when given) and re-raises that same
    exception; leaving it cleanly publishes `workflow-completed`. Calls still in flight at exit
    (tasks the block did not await) are waited for, up to `settle_timeout` seconds, so that the
    count covers them and no step arrives after the workflow ended.

    `servers` maps the names the worker's registry uses to connected `mcp.Client`s; events carry
    those names, never URLs. With a `config` (`saga.config.Config`), an operator overlay for
    (server, tool) is what the event's `recovery` carries, in place of what the server declares
    (the coordinator applies the same rule; recording it here tells every other reader of the
    stream too), and the config's prefix names the stream.

    `redis` may be a `redis+sentinel://` URL (runtime/sentinel.py); with a config and no URL, its
    `[redis] sentinels` name the Redis. The config's `[redis] wait_replicas` makes each event count
    as written only once that many replicas confirmed it (runtime/durability.py).
    `intents` (default on): before each call, a `step-started` with the call's forward key is
    written and acknowledged by Redis, and the key goes to the server in the request `_meta`; so a
    call whose answer never arrives (a timeout, a dropped connection, the agent killed) is known
    to the coordinator as in doubt and settled in the unwind. Off, only completed calls are
    recorded and such a call is never undone (the v1 behaviour), one Redis round trip less per call.
    """

    def __init__(
        self,
        workflow_id: str,
        *,
        redis: aioredis.Redis | str | None = None,
        servers: Mapping[str, Client],
        config: Config | None = None,
        parallel: bool | None = None,
        on_failure: OnFailure | None = None,
        prefix: str | None = None,
        settle_timeout: float = 30.0,
        intents: bool = True,
    ) -> None:
        check_workflow_id(workflow_id)
        if on_failure is not None and on_failure not in get_args(OnFailure):
            raise ValueError(f"on_failure must be one of {get_args(OnFailure)}, not {on_failure!r}")
        for name in servers:
            if not isinstance(name, str) or not 1 <= len(name) <= 128 or "://" in name:
                raise ValueError(f"server name {name!r}: use the worker registry's name (1-128 characters), not a URL")
            if config is not None and config.servers and name not in config.servers:
                log.warning("server %r is not in the config's [servers]; a worker with it could not compensate", name)
        if isinstance(redis, SyncRedis):
            raise TypeError("pass a redis.asyncio.Redis (or a URL): a blocking client would stall the event loop")
        url = redis if isinstance(redis, str) else None if redis is not None else os.environ.get("REDIS_URL")
        if redis is None and url is None and config is not None:
            url = sentinel_url(config.redis)
        if redis is None and url is None:
            raise ValueError(
                "no Redis: pass redis= (a redis.asyncio.Redis or a URL), set REDIS_URL, or give a config "
                "naming [redis] sentinels"
            )
        if url is not None and is_sentinel_url(url):
            parse_sentinel_url(url, where="redis=")  # a malformed URL fails here, not at the first step
        self.id = workflow_id
        self.servers = dict(servers)
        self.config = config
        self.parallel, self.on_failure, self.settle_timeout = parallel, on_failure, settle_timeout
        self.intents = intents
        self._redis, self._url = redis, url
        self._prefix = prefix or (config.prefix if config else "saga")
        self.publisher: AsyncPublisher | None = None
        # Tool calls that succeeded, recorded or not: a step whose event could not be written still
        # counts, so that the coordinator flags it as missing instead of reporting a clean unwind.
        self.steps_completed = 0
        self._counter = 0
        self._used: set[str] = set()
        self._inflight: set[asyncio.Future[None]] = set()
        self._failure: tuple[BaseException, FailedStep] | None = None
        self._last_write: asyncio.Task[None] | None = None
        self._write_error: tuple[str, Exception] | None = None
        self._state = "new"
        self._span: Any = None  # the workflow's OpenTelemetry span, when the agent traces

    async def __aenter__(self) -> Workflow:
        if self._state != "new":
            raise RuntimeError(f"workflow {self.id!r} was already entered; create a new one per run")
        # redis-py's from_url connects without retries (Redis() has them): without these, a Redis
        # restart of a few milliseconds fails every step written meanwhile. A repeated XADD is harmless.
        retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), 10)
        settings = self.config.redis if self.config is not None else RedisSettings()
        connection = connect_async(self._url, settings, retry=retry) if self._url is not None else self._redis
        durability = Durability.of(settings)
        # The events ride one connection per event loop and Redis, shared by the loop's workflows
        # (runtime/pipelined.py): redis-py's own cost per XADD was most of what a step added to its call.
        # Its writes are sent again after a lost connection (a restart), not after a reply that is
        # REPLY_TIMEOUT late: each such try would hold the agent's call that long again, and a
        # stopped Redis held a call for two minutes.
        pipe = await shared_pipelined(self._url if self._url is not None else connection, settings)
        resend = Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), 10, supported_errors=(RedisConnectionError,))
        self.publisher = AsyncPublisher(
            connection, self._prefix, settings.partitions, durability=durability, pipe=pipe, retry=resend
        )
        self._span = tracing.workflow_span(self.id)
        self._state = "open"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._state = "closed"
        assert self.publisher is not None
        try:
            if self._inflight:
                await asyncio.wait(set(self._inflight), timeout=self.settle_timeout)
            await self._written()
            if exc is None:
                if self._write_error is not None:  # nothing will be undone, so the loss is only logged
                    log.warning("workflow %r completed with step %r unrecorded", self.id, self._write_error[0])
                await self.publisher.publish(self.id, WorkflowCompleted())
                return
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            failed = self._failed_step(exc)
            payload = workflow_failed(
                reason, failed, self.steps_completed, self.parallel, self.on_failure, tracing.wire_of(self._span)
            )
            try:
                await self.publisher.publish(self.id, payload)
            except Exception as error:  # the block's own exception is the one the caller must see
                log.error("could not publish workflow-failed for %r: %r", self.id, error)
                exc.add_note(f"mcp-saga: workflow-failed for {self.id!r} was NOT published: {error!r}")
        finally:
            tracing.end(self._span, None if exc is None else type(exc).__name__)
            if self._url is not None:
                await self.publisher.redis.aclose()

    def _failed_step(self, exc: BaseException) -> FailedStep | None:
        """The failed call, when the exception leaving the block is it or was raised while handling it."""
        if self._failure is None:
            return None
        seen: BaseException | None = exc
        for _ in range(50):  # bounded walk: a cause chain can be a cycle
            if seen is None:
                return None
            if seen is self._failure[0]:
                return self._failure[1]
            seen = seen.__cause__ or seen.__context__
        return None

    def _step_id(self, tool: str, step: str | None) -> str:
        if step is not None:
            check_step_id(step)
            if step in self._used:
                raise ValueError(f"step id {step!r} is already used in workflow {self.id!r}")
        while step is None or step in self._used:
            self._counter += 1
            step = _NOT_STEP_CHARS.sub("_", f"{self._counter}-{tool}")[:64]
        self._used.add(step)
        return step

    async def call(
        self,
        server: str,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        step: str | None = None,
        **call_kwargs: Any,
    ) -> CallToolResult:
        """Call `tool` on `server`; on success its step-completed is on its way to the stream.

        `step` defaults to `"{n}-{tool}"`. Extra keyword arguments go to `Client.call_tool`
        (`read_timeout_seconds`, `meta`, ...). Raises `ToolCallFailed` for `isError: true`; a
        transport or protocol error propagates as is. Either way nothing is published for the call,
        and the block's exit names it as the failed step. A result over the event cap is returned
        whole; its event keeps what the recovery binds (`fit_step`). A step whose event cannot be
        written still counts in `stepsCompleted`, so the coordinator flags it: a Redis error
        surfaces as `StepNotRecorded` from the next call (before its tool runs), `flush()`, or the
        block's exit.
        """
        if self._state != "open":
            raise RuntimeError(f"workflow {self.id!r} is {self._state}: call inside `async with`")
        self._raise_write_error()
        client = self.servers.get(server)
        if client is None:
            raise ValueError(f"unknown server {server!r} for workflow {self.id!r}; known: {sorted(self.servers)}")
        listing = _declarations(client)
        step_id = self._step_id(tool, step)
        arguments = dict(arguments or {})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight.add(done)
        span = tracing.call_span(self._span, server, tool, step_id)
        announced = False
        # The caller's own idempotency key for the call, when it sends one (as the gateway does): the
        # server sees it, so it is the forward key a recall must repeat; else (workflow, step)'s.
        meta = dict(call_kwargs.pop("meta", None) or {})
        try:
            try:
                if self.intents:
                    own = meta.get(IDEMPOTENCY_META_KEY)
                    key = own if isinstance(own, str) and own else forward_key(self.id, step_id)
                    trace = tracing.wire_of(span)
                    patience = _seconds(call_kwargs.get("read_timeout_seconds"))
                    announced = await self._announce(step_id, server, tool, arguments, listing, trace, key, patience)
                if announced:
                    meta[IDEMPOTENCY_META_KEY] = key
                if meta:
                    call_kwargs["meta"] = meta
                with tracing.current(span):
                    result = await client.call_tool(tool, arguments, **call_kwargs)
                if result.is_error:
                    if announced:  # an answer, if an error one: the intent is settled as nothing done
                        wire = result.model_dump(by_alias=True, mode="json", exclude_none=True)
                        self._write(step_id, step_entry(self.id, step_id, server, tool, arguments, wire))
                    raise ToolCallFailed(server, tool, step_id, result)
            except BaseException as exc:
                # Never completed: the caller may retry under the same id, which sends the same forward
                # key again, so a server that honours it does not repeat an effect that landed.
                self._used.discard(step_id)
                error = result_text(exc.result) if isinstance(exc, ToolCallFailed) else f"{type(exc).__name__}: {exc}"
                self._failure = (exc, FailedStep(tool=tool, error=clip(error)))
                tracing.end(span, error)
                raise
            tracing.end(span)
            self.steps_completed += 1
            await self._publish_step(step_id, server, tool, arguments, result, listing, tracing.wire_of(span))
            return result
        finally:
            self._inflight.discard(done)
            done.set_result(None)

    async def _announce(
        self,
        step: str,
        server: str,
        tool: str,
        arguments: dict[str, Any],
        listing: asyncio.Future[dict[str, ToolDeclaration]],
        trace: TraceContext | None,
        key: str,
        patience: float | None = None,
    ) -> bool:
        """Write the call's intent and wait for Redis to acknowledge it; raise `StepNotRecorded` if it cannot.

        False (nothing written) only for an intent over the event cap, which goes unannounced.
        The intent carries the tool's declaration, so the session's `tools/list` is waited for, at
        most `patience` (the call's own read timeout): a server that answers neither must time the
        call out as it would without intents, not hang the agent; the call is then not made."""
        assert self.publisher is not None
        if patience is not None and not (await asyncio.wait([listing], timeout=patience))[0]:
            raise TimeoutError(
                f"{server}: tools/list, which the intent of step {step!r} needs, got no answer within "
                f"{patience:g} s (the call's read timeout); the call was not made"
            )
        recovery, annotations = await self._declaration(server, tool, listing, step)
        fields = started_entry(self.id, step, server, tool, arguments, recovery, annotations, trace, key)
        if fields is None:
            log.warning("step %r of workflow %r: intent over the event cap; the call goes unannounced", step, self.id)
            return False
        try:
            await self.publisher.add(self.id, fields, f"intent of step {step!r} of {self.id!r}")
        except Exception as exc:
            raise StepNotRecorded(
                f"the intent of step {step!r} of workflow {self.id!r} was not written; the call was not made: {exc!r}"
            ) from exc
        return True

    async def _declaration(
        self, server: str, tool: str, listing: asyncio.Future[dict[str, ToolDeclaration]], step: str
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(recovery, annotations) as an event carries them: the overlay first, else the server's listing."""
        recovery, annotations = None, None
        try:
            declaration = (await listing).get(tool)
        except Exception as exc:  # the call committed: record it even without its declaration
            log.warning("tools/list of %r failed (%r); step %r is published without its declaration", server, exc, step)
            declaration = None
        if declaration is not None:
            recovery = declaration.recovery
            if recovery is not None and not isinstance(recovery, dict):
                # Not an object: keep it visible, in a shape the coordinator plans as unrecoverable.
                recovery = {"declared": recovery}
            annotations = {k: v for k, v in declaration.annotations.items() if k != "recovery"} or None
        return self._overlay(server, tool) or recovery, annotations

    def _overlay(self, server: str, tool: str) -> dict[str, Any] | None:
        overlay = self.config.overlay(server, tool) if self.config is not None else None
        return overlay.to_wire() if overlay is not None else None

    async def _publish_step(
        self,
        step: str,
        server: str,
        tool: str,
        arguments: dict[str, Any],
        result: CallToolResult,
        listing: asyncio.Future[dict[str, ToolDeclaration]],
        trace: TraceContext | None = None,
    ) -> None:
        recovery, annotations = await self._declaration(server, tool, listing, step)
        wire = result.model_dump(by_alias=True, mode="json", exclude_none=True)
        # The agent keeps the whole result; over the cap, the event keeps what undoing needs (fit_step).
        self._write(step, step_entry(self.id, step, server, tool, arguments, wire, recovery, annotations, trace))

    def _write(self, step: str, fields: dict[bytes, bytes]) -> None:
        """XADD in a task chained after the previous one: stream order is completion order, and the
        Redis round trip overlaps whatever the agent does next instead of delaying this call."""
        previous, publisher = self._last_write, self.publisher
        assert publisher is not None

        async def write() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            try:
                await publisher.add(self.id, fields, f"step {step!r} of {self.id!r}")
            except Exception as exc:
                log.error("step %r of workflow %r was not recorded: %r", step, self.id, exc)
                self._write_error = self._write_error or (step, exc)

        self._last_write = asyncio.create_task(write())

    async def _written(self) -> None:
        if self._last_write is not None:
            await asyncio.wait([self._last_write])

    def _raise_write_error(self) -> None:
        if self._write_error is not None:
            step, exc = self._write_error
            raise StepNotRecorded(
                f"step {step!r} of workflow {self.id!r} was not written to the stream: {exc!r}"
            ) from exc

    async def flush(self) -> None:
        """Wait until Redis has every step published so far; raise `StepNotRecorded` if one was lost.

        For an agent about to do something it could not take back outside MCP: `wf.call` returns
        once the step's XADD is under way, not confirmed.
        """
        await self._written()
        self._raise_write_error()


def _seconds(timeout: Any) -> float | None:
    """A `read_timeout_seconds` as `Client.call_tool` takes it (seconds, or a `timedelta`)."""
    if isinstance(timeout, int | float):
        return float(timeout)
    seconds = getattr(timeout, "total_seconds", None)
    return float(seconds()) if callable(seconds) else None


# `mcp_saga.workflow("order-42", redis=..., servers={"payments": client})`: the lowercase name reads as
# what it is used as, an `async with` block; the class documents the arguments.
workflow = Workflow


__all__ = ["StepNotRecorded", "ToolCallFailed", "Workflow", "forget_declarations", "workflow"]
