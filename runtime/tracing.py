"""OpenTelemetry traces from the agent's tool call to each compensation at the server (optional).

One trace per workflow: the SDK opens a span for the workflow and one per recorded call, and puts
the W3C trace context of each (`traceparent`, `tracestate`) in the event it publishes (`trace`).
The coordinator's transition continues the context of the event that caused it and hands its own
to the jobs it dispatches; the worker's attempt continues the job's, sends it to the MCP server in
the `tools/call` request `_meta` (the convention proposed for MCP trace propagation) and returns it
in its report, so the next transition continues from there.

Off unless configured, and then nothing of OpenTelemetry is imported:

- processes (`saga coordinator`, `saga worker`, the gateway) call `setup(component)`, which turns
  tracing on when the standard variables ask for an exporter: `OTEL_TRACES_EXPORTER` (`otlp`,
  `console`; `none` is off) or `OTEL_EXPORTER_OTLP_ENDPOINT` / `..._TRACES_ENDPOINT`, unless
  `OTEL_SDK_DISABLED=true`. The exporter reads its own `OTEL_EXPORTER_OTLP_*` variables; sampling
  follows `OTEL_TRACES_SAMPLER`; `OTEL_SERVICE_NAME` defaults to `saga-<component>`.
  `SAGA_TRACES_FILE` sends the `console` exporter's spans to a file, one JSON object a line.
- the SDK traces under the agent's own tracer provider when the agent has set one up (the
  agent owns its OpenTelemetry configuration), or after `setup("agent")`.

Where this process does not trace, a context that arrives is handed on unchanged, so a trace
passes through an untraced coordinator. Whatever the configuration, the trace id of each workflow
seen lately is remembered, so that every log line of a workflow names it (`runtime/logs.py`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import SimpleNamespace, TracebackType
from typing import TYPE_CHECKING, Any

from mcp_saga.schemas.events import Report, StepCompleted, TraceContext

if TYPE_CHECKING:
    from mcp_saga.schemas.records import CompensationJob

TRACEPARENT = re.compile(
    r"^(?P<version>[0-9a-f]{2})-(?P<trace>[0-9a-f]{32})-(?P<span>[0-9a-f]{16})-(?P<flags>[0-9a-f]{2})$"
)
INSTRUMENTATION = "mcp_saga"
# The MCP SDK's own tracer (mcp/shared/_otel.py), which spans every request a client sends.
MCP_SDK_TRACER = "mcp-python-sdk"
_ON_VALUES = {"otlp", "console"}
# `_Lean` hands the spans it holds to the processors this many at a time, or once the oldest waited this long.
HAND_OVER_AT = 32
HAND_OVER_AFTER = 1.0
_state: dict[str, Any] = {"on": None, "tracer": None, "quiet": frozenset()}


# Trace ids of recent workflows, for log lines --------------------------------------------------

_RECENT_MAX = 10_000
_recent: OrderedDict[str, str] = OrderedDict()


def remember(workflow: str, carrier: Mapping[str, str] | TraceContext | None) -> None:
    """Note a workflow's trace id (from a `traceparent`), so its log lines can carry it."""
    traceparent = carrier.traceparent if isinstance(carrier, TraceContext) else (carrier or {}).get("traceparent")
    match = TRACEPARENT.match(traceparent or "")
    if match is not None:
        _remember_id(workflow, match["trace"])


def _remember_id(workflow: str, trace: str) -> None:
    # Without a lock: each step is one atomic operation of the C OrderedDict, and a race costs at
    # most an entry's place in the order or one too many trimmed (a lock was a tenth of a worker attempt's tracing).
    _recent.pop(workflow, None)
    _recent[workflow] = trace  # at the end: the most recent
    if len(_recent) > _RECENT_MAX:
        _recent.popitem(last=False)


def trace_id(workflow: str) -> str | None:
    return _recent.get(workflow)


# Configuration --------------------------------------------------------------------------------


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = {e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if exporters:
        return bool(exporters & _ON_VALUES)
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(component: str) -> bool:
    """Install a tracer provider from the environment when it asks for one; True when tracing is on.

    In the worker, the attempt's span is the client span of its `tools/call` (the server continues
    it from `_meta`), so the MCP SDK's own span of each request is left out there: it doubled the
    spans of an attempt, and made a trace of its own of every `tools/list` a worker sends.
    """
    if _state["on"] is not None:
        return _state["on"]
    if not wanted():
        _state["on"] = False
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        sys.stderr.write("OTEL_* asks for traces but OpenTelemetry is not installed: pip install 'mcp-saga[tracing]'\n")
        _state["on"] = False
        return False
    quiet = frozenset({MCP_SDK_TRACER} if component == "worker" else ())

    class Provider(TracerProvider):
        hands_over = True  # `_Lean` may hand its spans to the processors in batches: `force_flush` drains them

        def get_tracer(self, instrumenting_module_name: str, *args: Any, **kwargs: Any) -> Any:
            if instrumenting_module_name in quiet:
                return trace.NoOpTracer()  # hands on the current context, records nothing
            return super().get_tracer(instrumenting_module_name, *args, **kwargs)

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            _hand_over()
            return super().force_flush(timeout_millis)

        def shutdown(self) -> None:
            _hand_over()
            super().shutdown()

    class Hashed(Resource):
        """The resource, its hash computed once: the OTLP exporter groups the spans of each batch by
        resource, hashing it twice per span, and Resource hashes a JSON dump of its attributes (a
        tenth of what the worker's span costs). A resource is immutable, so its hash never changes."""

        def __init__(self, resource: Resource) -> None:
            super().__init__(resource.attributes, resource.schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"saga-{component}"})
    provider = Provider(resource=Hashed(resource))
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _state.update(on=True, quiet=quiet, tracer=None)  # what `_provided` cached before is not this provider's
    return True


def _exporters() -> list[Any]:
    names = {e.strip() for e in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")} & _ON_VALUES
    exporters: list[Any] = []
    if "otlp" in names:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        path = os.environ.get("SAGA_TRACES_FILE")
        out = open(path, "a", buffering=1) if path else sys.stdout  # noqa: SIM115 - lives as long as the process
        exporters.append(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
    return exporters


def active() -> bool:
    """Whether spans are recorded here: `setup` turned tracing on, or the agent configured OpenTelemetry."""
    if _state["on"]:
        return True
    if "opentelemetry.trace" not in sys.modules:  # never imported: certainly off, and it stays unimported
        return False
    from opentelemetry import trace

    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def shutdown() -> None:
    """Export what is buffered (a process that ends by `os._exit` or a signal would lose it)."""
    if _state["on"]:
        from opentelemetry import trace

        trace.get_tracer_provider().shutdown()  # type: ignore[attr-defined]


# Spans ----------------------------------------------------------------------------------------


def _provided() -> tuple[Any, Any, bool, Any]:
    """(provider, this package's tracer, whether its sampler drops unsampled remote parents, the
    `_Lean` recipe when the tracer allows one), made once per provider: the SDK builds a new tracer
    (and its scope) on every `get_tracer`."""
    provider = _api().trace.get_tracer_provider()
    cached = _state["tracer"]
    if cached is None or cached[0] is not provider:
        sampler = getattr(provider, "sampler", None)
        drops = sampler is not None and "remoteParentNotSampled:AlwaysOffSampler" in sampler.get_description()
        tracer = provider.get_tracer(INSTRUMENTATION)
        cached = _state["tracer"] = (provider, tracer, drops, _Lean.of(tracer, getattr(provider, "hands_over", False)))
    return cached


def _hand_over() -> None:
    """Give the processors the spans `_Lean` holds (before a flush or a shutdown exports what they hold)."""
    cached = _state["tracer"]
    if cached is not None and cached[3] is not None:
        cached[3].hand_over()


def _tracer() -> Any:
    return _provided()[1]


def _parent(carrier: Mapping[str, str] | None) -> Any:
    """The context a carrier names, read here: the global propagator (trace context and baggage
    behind a composite) cost as much as the span itself. Anything unusual goes to the propagator."""
    if not carrier:
        return None
    return _context_of(TRACEPARENT.match(carrier.get("traceparent") or ""), carrier)


def _api() -> Any:
    """The OpenTelemetry API names a span needs, imported once: an import statement in a function
    runs the import machinery on every call, and a worker's attempt went through four."""
    api = _state.get("api")
    if api is None:
        from opentelemetry import trace
        from opentelemetry.context import Context

        api = _state["api"] = SimpleNamespace(
            trace=trace,
            Context=Context,
            CLIENT=trace.SpanKind.CLIENT,
            INTERNAL=trace.SpanKind.INTERNAL,
            NonRecordingSpan=trace.NonRecordingSpan,
            SpanContext=trace.SpanContext,
            TraceFlags=trace.TraceFlags,
            TraceState=trace.TraceState,
        )
    return api


def _context_of(match: re.Match[str] | None, carrier: Mapping[str, str]) -> Any:
    """`_parent`'s work, for a caller that has matched the carrier's `traceparent` already."""
    if match is None or match["version"] != "00":
        from opentelemetry.propagate import extract

        return extract(dict(carrier))
    api = _api()
    state = carrier.get("tracestate")
    context = api.SpanContext(
        int(match["trace"], 16),
        int(match["span"], 16),
        is_remote=True,
        trace_flags=api.TraceFlags(int(match["flags"], 16)),
        trace_state=api.TraceState.from_header([state]) if state else None,
    )
    if not context.is_valid:  # all-zero ids: a fresh trace, as the propagator would start
        return api.Context()
    return api.trace.set_span_in_context(api.NonRecordingSpan(context))


def records(carrier: Mapping[str, str]) -> bool:
    """Whether a span continuing this carrier would be recorded here.

    A parent the agent's sampler left out (flags 00) is dropped by the default sampler
    (ParentBased); the span would then be a placeholder with a new id that nobody sees, so the
    carrier is handed on as it is and no span is made at all.
    """
    return _records(TRACEPARENT.match(carrier.get("traceparent") or ""))


def _records(match: re.Match[str] | None) -> bool:
    if match is None or int(match["flags"], 16) & 1:
        return True
    return not _provided()[2]


def carrier_of(span: Any) -> dict[str, str]:
    """The span's W3C context as the headers `traceparent` (and `tracestate`).

    Formatted here rather than through the propagator, which builds a context to read it back
    from and costs about as much as the span itself.
    """
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"}
    if context.trace_state:
        headers["tracestate"] = context.trace_state.to_header()
    return headers


def to_wire(carrier: Mapping[str, str] | None) -> TraceContext | None:
    if not carrier or "traceparent" not in carrier:
        return None
    return TraceContext(traceparent=carrier["traceparent"], tracestate=carrier.get("tracestate") or None)


def from_wire(trace: TraceContext | None) -> dict[str, str] | None:
    if trace is None or TRACEPARENT.match(trace.traceparent) is None:
        return None
    return {"traceparent": trace.traceparent} | ({"tracestate": trace.tracestate} if trace.tracestate else {})


def start_span(
    name: str,
    parent: Mapping[str, str] | Any | None = None,
    *,
    kind: str = "INTERNAL",
    start: float | None = None,
    **attributes: Any,
) -> Any:
    """A started span (the caller ends it); `parent` is a carrier dict or a span, `start` a Unix time."""
    from opentelemetry import trace

    is_span = parent is not None and not isinstance(parent, Mapping)
    context = trace.set_span_in_context(parent) if is_span else _parent(parent)
    clean = {k: v for k, v in attributes.items() if v is not None}
    start_time = int(start * 1e9) if start is not None else None
    return _tracer().start_span(
        name, context=context, kind=getattr(trace.SpanKind, kind), attributes=clean, start_time=start_time
    )


def fail(span: Any, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description[:500]))


# The coordinator ------------------------------------------------------------------------------


class BatchTraces(dict[str, dict[str, str]]):
    """Per workflow of a batch, the context of its last event other than a step that carried one;
    and apart, in `steps`, the last step's (unchecked until used)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, TraceContext] = {}

    def for_jobs(self, workflow: str) -> dict[str, str] | None:
        """The context a transition that dispatches jobs continues: its event's, else its last step's.

        A failure that arrives before the steps it announced waits for them (the barrier); when the
        step that completes the barrier is handled by another coordinator than the failure, that
        batch holds only the step, and without it the jobs, and every span after them, lost the trace.
        """
        carrier = self.get(workflow)
        if carrier is None and workflow in self.steps:
            carrier = from_wire(self.steps[workflow])
            if carrier is not None:
                remember(workflow, carrier)
        return carrier


def event_traces(groups: Mapping[str, Iterable[tuple[Any, Any]]]) -> BatchTraces:
    """Per workflow of a batch, the context of its last event (other than a step) that carried one.

    Steps are only noted (their context is read only for a transition that dispatches jobs, see
    `BatchTraces.for_jobs`): most events are steps of running workflows, which no transition span
    follows (see `transitions`), and checking each would cost ingest a few per cent.
    """
    found = BatchTraces()
    for workflow, items in groups.items():
        for event, _ in items:
            if type(event.data) is StepCompleted:
                if event.data.trace is not None:
                    found.steps[workflow] = event.data.trace
                continue
            carrier = from_wire(getattr(event.data, "trace", None))
            if carrier is not None:
                found[workflow] = carrier
        if workflow in found:
            remember(workflow, found[workflow])
    return found


def begin_transitions(views: Iterable[Any], traces: Mapping[str, dict[str, str]], started: float) -> dict[str, Any]:
    """A span per transition of a traced workflow, before its commit; its jobs carry that span's context.

    Begun before the commit because the commit may carry the jobs to the queue (Store.commit); the
    caller ends the spans of the workflows whose commit applied, and drops the others', which then
    never export. Untraced here, the jobs carry the event's context unchanged. Recording a step of a
    running workflow is not a transition worth a span (the agent's call span already shows it) and
    never reaches here: those steps take the coordinator's fast path.
    """
    spans: dict[str, Any] = {}
    if not traces and not getattr(traces, "steps", None):
        return spans
    on = active()
    for view in views:
        carrier = traces.get(view.workflow)
        if carrier is None and view.jobs and isinstance(traces, BatchTraces):
            carrier = traces.for_jobs(view.workflow)
        if carrier is None:
            continue
        if on:
            attributes = {
                "saga.workflow": view.workflow,
                "saga.status.from": view.loaded_status or "new",
                "saga.status.to": view.state.status,
                "saga.jobs": len(view.jobs),
            }
            match = TRACEPARENT.match(carrier.get("traceparent") or "")
            lean = _lean_for(match)
            if lean is not None and match is not None:
                start = int(started * 1e9)  # the batch's start: the span covers the fold and the commit
                span = _LeanSpan(lean, "saga transition", match, carrier.get("tracestate"), attributes, start)
                carrier = span.carrier
            else:
                span = start_span("saga transition", carrier, start=started, **attributes)
                carrier = carrier_of(span)
            spans[view.workflow] = span
        if view.jobs:
            view.jobs[:] = [_with_trace(job, carrier) for job in view.jobs]
    return spans


def _with_trace(job: CompensationJob, carrier: dict[str, str]) -> CompensationJob:
    import msgspec

    then = tuple(msgspec.structs.replace(m, trace=carrier) for m in job.then)  # a routing slip's steps too
    return msgspec.structs.replace(job, trace=carrier, then=then)


# The worker -----------------------------------------------------------------------------------


class _Lean:
    """What the SDK's tracer does for a worker attempt's span (and a coordinator's transition span),
    done without its `Span`, where the tracer's configuration makes that the same span (`of`
    checks; any other goes the SDK's way).

    Amid a real attempt (issue 17, Cost), the SDK's `start_span` and `end` cost the worker's main
    thread about 160 us, ten times what they cost in a loop: its sampler, ids, context objects,
    locks and bounded attributes are a lot of code that the MCP call between two attempts pushes
    out of the caches. For a span whose parent is a sampled remote context (every traced job and
    event) under the default sampler (ParentBased: such a parent is always sampled), with no span
    limit that could cut our few attributes, no processor that acts on a span's start, and the
    tracer's own metrics off, that work comes down to a span id, two timestamps and, at the end, the
    `ReadableSpan` the SDK's span hands its processors: the same name, ids, parent, flags, trace
    state, kind, attributes, status, resource and scope, so every processor and exporter the
    OTEL_* variables configure gets what the SDK's span would have given it.

    Even that, done at each span's end, cost an attempt 50-70 us of its thread amid the real work
    (9 us in a loop): the contexts, the `ReadableSpan` and three processor calls down to the batch
    processor's queue, all cold again. So under the provider `setup` installs (`hands_over`), and
    unless a processor exports as each span ends (`SimpleSpanProcessor`: the console exporter of a
    test, say), an ended span only joins `held`, and the processors receive the held spans
    `HAND_OVER_AT` at a time, one after the other while that code is warm, or once the oldest has
    waited `patience` (a thread of ours looks twice as often), or on the provider's `force_flush`
    and `shutdown`. The batch processor holds its spans for seconds anyway (5 by default); a span
    reaches it at most a second or a fifth of its delay later, and a SIGKILL loses what either held.
    """

    __slots__ = (
        "ReadableSpan",
        "api",
        "checked",
        "handing",
        "held",
        "holds",
        "no_ops",
        "patience",
        "processor",
        "simple",
        "tracer",
    )  # fmt: skip

    def __init__(self, tracer: Any, no_ops: frozenset[Any], readable: type, simple: type, holds: bool) -> None:
        self.api, self.tracer, self.processor = _api(), tracer, tracer.span_processor
        self.checked: Any = None
        self.ReadableSpan, self.no_ops, self.simple = readable, no_ops, simple
        self.holds = holds  # whether the provider allows it; `handing`: whether the processors do too
        self.handing, self.patience = False, HAND_OVER_AFTER
        self.held: deque[_LeanSpan] = deque()
        self.fits()  # the patience, before the watch starts waiting
        self._watch()

    @classmethod
    def of(cls, tracer: Any, holds: bool = False) -> _Lean | None:
        try:
            from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, Tracer
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
        except ImportError:
            return None
        if type(tracer) is not Tracer or not isinstance(tracer.sampler, ParentBased):
            return None
        if getattr(tracer.sampler, "_remote_parent_sampled", None) is not ALWAYS_ON:
            return None
        config = getattr(tracer, "_tracer_config", None)
        metrics = getattr(tracer, "_tracer_metrics", None)
        limits = getattr(tracer, "_span_limits", None)
        if config is not None and not config.is_enabled:
            return None
        if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
            return None
        if limits is None or limits.max_span_attribute_length is not None:
            return None
        if limits.max_span_attributes is not None and limits.max_span_attributes < 8:
            return None
        if getattr(tracer.span_processor, "_span_processors", None) is None:
            return None
        no_ops = frozenset(
            getattr(kind, hook, None)
            for kind in (SpanProcessor, BatchSpanProcessor, SimpleSpanProcessor)
            for hook in ("on_start", "_on_ending")
        )
        return cls(tracer, no_ops, ReadableSpan, SimpleSpanProcessor, holds)

    def fits(self) -> bool:
        """Whether every processor ignores a span's start and ending (checked again when one is added)."""
        processors = self.processor._span_processors
        if processors is not self.checked:
            if self.checked is not None:  # what ended before the change goes to the processors of then
                self.hand_over(self.checked)
            quiet = all(
                getattr(type(p), hook, None) in self.no_ops for p in processors for hook in ("on_start", "_on_ending")
            )
            self.checked = processors if quiet else None
            self.handing = self.holds and not any(isinstance(p, self.simple) for p in processors)
            # Never later than a fifth of what a batch processor is told to wait (OTEL_BSP_SCHEDULE_DELAY).
            delays = [getattr(getattr(p, "_batch_processor", None), "_schedule_delay", None) for p in processors]
            self.patience = min([HAND_OVER_AFTER, *(d / 5 for d in delays if isinstance(d, int | float))])
        return self.checked is not None

    def ended(self, span: _LeanSpan) -> None:
        if not self.handing:
            self.processor.on_end(span.readable())
            return
        self.held.append(span)
        if len(self.held) >= HAND_OVER_AT:
            self.hand_over()

    def hand_over(self, processors: Iterable[Any] | None = None) -> None:
        """The held spans to the processors (to `processors` when given); safe from any thread (each
        span is taken once)."""
        held, to = self.held, [self.processor] if processors is None else list(processors)
        while True:
            try:
                span = held.popleft()
            except IndexError:
                return
            readable = span.readable()
            for processor in to:
                processor.on_end(readable)

    def _watch(self) -> None:
        """Hands the held spans over once the oldest has waited `patience` (a quiet process's last ones)."""
        if not self.holds:
            return

        def watch() -> None:
            while True:
                time.sleep(self.patience / 2)
                held = self.held
                if held and held[0].ended_at < time.time_ns() - self.patience * 1e9:
                    self.hand_over()

        threading.Thread(target=watch, name="saga-span-hand-over", daemon=True).start()
        os.register_at_fork(after_in_child=self.held.clear)  # the parent hands those over; the thread is not here


class _LeanSpan:
    """A span `_Lean` makes: what it needs until the processors receive it.

    The worker's attempt span (a client span: its `tools/call`) and the coordinator's transition
    span (internal, started at its batch's start): the SDK's `start_span` and `end` cost a
    transition about 52 us in a loop, this way 12-18 us (issue 17, Cost: ingest). Only what the
    carrier needs is computed as it starts; the parent's ids are parsed and the contexts built
    when the span is handed over (`readable`)."""

    __slots__ = (
        "attributes",
        "carrier",
        "ended_at",
        "kind",
        "lean",
        "match",
        "name",
        "span_id",
        "start",
        "state",
        "status",
    )  # fmt: skip

    def __init__(
        self,
        lean: _Lean,
        name: str,
        match: re.Match[str],
        state: str | None,
        attributes: dict,
        start: int | None = None,
        kind: Any = None,
    ) -> None:
        self.start = time.time_ns() if start is None else start
        self.lean, self.name, self.match, self.attributes, self.kind = lean, name, match, attributes, kind
        self.status = None
        self.span_id = lean.tracer.id_generator.generate_span_id()
        # The SDK's flags for the child of a sampled parent: sampled, and the parent's random-id bit.
        flags = "03" if int(match["flags"], 16) & 0x02 else "01"
        self.carrier = {"traceparent": f"00-{match['trace']}-{self.span_id:016x}-{flags}"}
        self.state = lean.api.TraceState.from_header([state]) if state else None
        if self.state:
            self.carrier["tracestate"] = self.state.to_header()

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.attributes.update(attributes)

    def set_status(self, status: Any) -> None:
        self.status = status

    def end(self) -> None:
        self.ended_at = time.time_ns()
        self.lean.ended(self)

    def readable(self) -> Any:
        """The `ReadableSpan` the SDK's span would have handed the processors at its end."""
        api, tracer, match = self.lean.api, self.lean.tracer, self.match
        trace_id, parent_flags = int(match["trace"], 16), int(match["flags"], 16)
        flags = api.TraceFlags(0x01 | (parent_flags & 0x02))
        return self.lean.ReadableSpan(
            self.name,
            context=api.SpanContext(trace_id, self.span_id, False, flags, self.state),
            parent=api.SpanContext(trace_id, int(match["span"], 16), True, api.TraceFlags(parent_flags), self.state),
            resource=tracer.resource,
            attributes=self.attributes,
            kind=api.INTERNAL if self.kind is None else self.kind,
            instrumentation_info=tracer.instrumentation_info,
            instrumentation_scope=tracer._instrumentation_scope,
            start_time=self.start,
            end_time=self.ended_at,
            **({"status": self.status} if self.status is not None else {}),
        )


def _lean_for(match: re.Match[str] | None) -> _Lean | None:
    """The `_Lean` recipe for a span continuing this `traceparent`, when it makes the SDK's span:
    a sampled, valid version-00 parent, and processors that ignore a span's start. Such a parent
    is recorded wherever a recipe exists (`_records`)."""
    if match is None or match["version"] != "00" or match["flags"][1] not in _ODD:
        return None
    if match["trace"] == _NO_TRACE or match["span"] == _NO_SPAN:
        return None
    cached = _state["tracer"]
    # Under `setup`'s provider (installed once for good) the recipe never changes.
    lean = cached[3] if _state["on"] and cached is not None else _provided()[3]
    return lean if lean is not None and lean.fits() else None


_ODD, _NO_TRACE, _NO_SPAN = frozenset("13579bdf"), "0" * 32, "0" * 16


class Attempt:
    """One compensation attempt's span, or the job's context passed through when this worker does not trace.

    The worker's per-attempt cost of tracing (issue 17, Cost: at most 5% of its throughput) is
    mostly the SDK's: making the span (see `_Lean`, which makes it for the usual configuration),
    and encoding it to protobuf in the exporter's thread, where each attribute adds about 3 us to
    the 13-19 us of a span without any (measured here), besides its cleaning and setting on the
    hot path. So the span carries only what a trace is read by: the workflow, step and server
    (the operation is in its name), then the outcome, and the attempt number when it is a retry
    (no attribute: the first attempt). The `traceparent` is matched once, and the parent context
    built from that match without the propagator.
    """

    __slots__ = ("carrier", "span")

    def __init__(self, job: CompensationJob) -> None:
        self.span: Any = None
        match = TRACEPARENT.match(job.trace.get("traceparent") or "") if job.trace else None
        if match is None:
            self.carrier: dict[str, str] = {}
            return
        _remember_id(job.workflow, match["trace"])
        lean = _lean_for(match)
        name = f"saga compensation {job.operation_id}"
        attributes = {"saga.workflow": job.workflow, "saga.step": job.step, "saga.server": job.server}
        if lean is not None:
            state = job.trace.get("tracestate") if job.trace else None
            self.span = _LeanSpan(lean, name, match, state, attributes, kind=lean.api.CLIENT)
            self.carrier = self.span.carrier
            return
        if not active() or not _records(match):
            self.carrier = dict(job.trace or {})
            return
        self.span = _provided()[1].start_span(
            name,
            context=_context_of(match, job.trace or {}),
            kind=_api().CLIENT,  # the span of the tools/call itself: the server continues it from `_meta`
            attributes=attributes,
        )
        self.carrier = carrier_of(self.span)

    def wire(self) -> TraceContext | None:
        return to_wire(self.carrier)

    def outcome(self, report: Report) -> None:
        if self.span is None:
            return
        if report.attempt > 1:
            self.span.set_attributes({"saga.attempt": report.attempt, "saga.outcome": report.TYPE})
        else:
            self.span.set_attribute("saga.outcome", report.TYPE)
        if report.TYPE not in ("compensation-succeeded", "recall-succeeded", "declaration-read"):
            fail(self.span, getattr(report, "error", None) or getattr(report, "reason", None) or report.TYPE)

    def end(self) -> None:
        if self.span is not None:
            self.span.end()
            self.span = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.end()


def attempt(job: CompensationJob) -> Attempt:
    """`with attempt(job) as traced:` the attempt's span, ended on the way out, whatever happens."""
    return Attempt(job)


# The agent (SDK) ------------------------------------------------------------------------------


def workflow_span(workflow: str) -> Any:
    """The span of a whole workflow, a child of whatever span the agent is in; None when not tracing."""
    if not active():
        return None
    return start_span("saga workflow", None, **{"saga.workflow": workflow})


def call_span(parent: Any, server: str, tool: str, step: str) -> Any:
    """The span of one recorded step (the MCP SDK's own `tools/call` client span nests under it)."""
    if parent is None:
        return None
    attributes = {"saga.step": step, "saga.server": server, "gen_ai.tool.name": tool}
    return start_span(f"saga step {tool}", parent, **attributes)


@contextmanager
def current(span: Any) -> Iterator[None]:
    """`span` as the current span: the MCP SDK (2.x traces each request, SEP-414) then opens its
    client span under it and injects that span's context into the request `_meta`."""
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


@contextmanager
def continued(carrier: Mapping[str, Any] | None) -> Iterator[None]:
    """The context a carrier (a request `_meta`) names, as the current one: the worker's call runs
    on the session pool's event loop, where the attempt's span is not current by itself.

    Not needed where the MCP SDK's spans are left out (the worker): the carrier is already in
    `_meta`, and the SDK adds nothing to it when no span is current."""
    if not carrier or not isinstance(carrier.get("traceparent"), str) or MCP_SDK_TRACER in _state["quiet"]:
        yield
        return
    from opentelemetry import context
    from opentelemetry.propagate import extract

    token = context.attach(extract({k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}))
    try:
        yield
    finally:
        context.detach(token)


def current_trace() -> TraceContext | None:
    """The current span's context for an event, e.g. in a gateway's tools/call handler, where the
    MCP SDK's server span continues the agent's `traceparent` from the request `_meta`."""
    if "opentelemetry.trace" not in sys.modules:
        return None
    from opentelemetry import trace

    return to_wire(carrier_of(trace.get_current_span()))


def end(span: Any, error: str | None = None) -> None:
    if span is None:
        return
    if error is not None:
        fail(span, error)
    span.end()


def wire_of(span: Any) -> TraceContext | None:
    return None if span is None else to_wire(carrier_of(span))


def sdk_spans() -> bool:
    """Whether the MCP SDK's client spans are recorded here: off in the worker, so its lean calls lose none."""
    return bool(_state["on"]) and MCP_SDK_TRACER not in _state["quiet"]
