"""What tracing does per compensation attempt in a worker, which has to stay cheap (issue 17, Cost).

One span per attempt, the client span of its `tools/call` (the MCP SDK's own span of each request
is left out in the worker, and the carrier in `_meta` is the attempt's); no span at all for an
attempt whose trace the agent's sampler left out, whose context then passes through unchanged.
Run in an interpreter of its own: OpenTelemetry's global tracer provider cannot be reset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from processes import REPO

SCRIPT = """
import json, sys
from mcp_saga.runtime import tracing
from mcp_saga.schemas.records import CompensationJob
from mcp_saga.schemas.events import CompensationFailed, CompensationSucceeded

assert tracing.setup("worker")
def job(flags, state=None):
    carrier = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-{flags}"} | ({"tracestate": state} if state else {})
    return CompensationJob(workflow="wf", step="s1", server="svc", tool="do", operation_id="undo",
                           arguments={}, idempotency_key="k", dispatch=1, trace=carrier)
report = CompensationSucceeded(step="s1", dispatch=1, attempt=1, final=True, server="svc", operation_id="undo",
                               idempotency_key="k", arguments_digest="d", duration_ms=1.0, worker="w", result={})
out = {}
with tracing.attempt(job("00")) as skipped:
    out["unsampled"] = {"span": skipped.span is not None, "carrier": skipped.carrier}
with tracing.attempt(job("01", "vendor=x")) as traced:
    out["sampled"] = {"carrier": traced.carrier}
    # What the session pool does around the call: the MCP SDK's span of the request, and its injection.
    from mcp.shared._otel import inject_trace_context, otel_span
    from opentelemetry.trace import SpanKind
    meta = dict(traced.carrier)
    with tracing.continued(meta), otel_span("MCP send tools/call undo", kind=SpanKind.CLIENT):
        inject_trace_context(meta)
    out["meta"] = meta
    traced.outcome(report)
retry = CompensationFailed(step="s1", dispatch=1, attempt=3, final=False, server="svc", operation_id="undo",
                           idempotency_key="k", arguments_digest="d", duration_ms=1.0, worker="w", error="boom",
                           retryable=True)
with tracing.attempt(job("01")) as retried:
    retried.outcome(retry)
tracing.shutdown()
print(json.dumps(out))
"""


def _script_spans(script: str, tmp_path: Path) -> tuple[dict, list[dict]]:
    """Run `script` with spans exported to a file: what it printed last, and the spans it exported."""
    spans_file = tmp_path / "spans.jsonl"
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "SAGA_TRACES_FILE": str(spans_file)}
    env.pop("OTEL_SDK_DISABLED", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out, [json.loads(line) for line in spans_file.read_text().splitlines()]


def test_a_worker_attempt_is_one_client_span_and_none_when_unsampled(tmp_path: Path) -> None:
    out, spans = _script_spans(SCRIPT, tmp_path)
    unsampled = f"00-{'ab' * 16}-{'cd' * 8}-00"
    assert out["unsampled"] == {"span": False, "carrier": {"traceparent": unsampled}}

    assert [s["name"] for s in spans] == ["saga compensation undo"] * 2  # no MCP SDK span beside them
    span, retried = spans
    assert span["kind"] == "SpanKind.CLIENT" and span["parent_id"] == "0x" + "cd" * 8
    assert span["context"]["trace_id"] == "0x" + "ab" * 16
    # The operation is in the name; a first attempt has no attempt number, a retry has.
    assert span["attributes"] == {
        "saga.workflow": "wf", "saga.step": "s1", "saga.server": "svc", "saga.outcome": "compensation-succeeded"
    }  # fmt: skip
    assert retried["attributes"]["saga.attempt"] == 3 and retried["attributes"]["saga.outcome"] == "compensation-failed"
    assert retried["status"]["status_code"] == "ERROR" and retried["status"]["description"] == "boom"
    mine = f"00-{'ab' * 16}-{span['context']['span_id'].removeprefix('0x')}-01"
    assert out["sampled"]["carrier"] == {"traceparent": mine, "tracestate": "vendor=x"}
    assert out["meta"] == out["sampled"]["carrier"]  # the server continues the attempt's span


def test_jobs_dispatched_by_a_batch_of_steps_only_carry_the_steps_trace() -> None:
    """The barrier's case: the failure came first (handled by one coordinator); the step that completes
    the barrier, handled by another, is all its batch holds, and its jobs must not lose the trace."""
    from types import SimpleNamespace

    from mcp_saga.runtime import tracing
    from mcp_saga.schemas.events import StepCompleted, TraceContext
    from mcp_saga.schemas.records import CompensationJob

    parent = f"00-{'ef' * 16}-{'12' * 8}-01"
    step = StepCompleted(step="s1", server="svc", tool="do", result={}, trace=TraceContext(traceparent=parent))
    untraced = StepCompleted(step="s1", server="svc", tool="do", result={})
    groups = {"wf": [(SimpleNamespace(data=step), {})], "plain": [(SimpleNamespace(data=untraced), {})]}
    traces = tracing.event_traces(groups)
    assert dict(traces) == {}  # steps are not read eagerly

    def view(workflow: str) -> SimpleNamespace:
        job = CompensationJob(
            workflow=workflow, step="s1", server="svc", tool="do", operation_id="undo", arguments={},
            idempotency_key="k", dispatch=1,
        )  # fmt: skip
        return SimpleNamespace(workflow=workflow, jobs=[job], loaded_status="failed", state=SimpleNamespace(status="x"))

    views = [view("wf"), view("plain")]
    assert tracing.begin_transitions(views, traces, 0.0) == {}  # untraced here: no span to end
    assert views[0].jobs[0].trace == {"traceparent": parent}  # untraced here: handed on as it came
    assert views[1].jobs[0].trace is None
    assert tracing.trace_id("wf") == "ef" * 16


SAME_SPAN = """
import json
from mcp_saga.runtime import tracing
from mcp_saga.schemas.records import CompensationJob
from mcp_saga.schemas.events import CompensationFailed
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor

assert tracing.setup("worker")
job = CompensationJob(workflow="wf", step="s1", server="svc", tool="do", operation_id="undo", arguments={},
                      idempotency_key="k", dispatch=1,
                      trace={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-03", "tracestate": "vendor=x"})
failed = CompensationFailed(step="s1", dispatch=1, attempt=2, final=True, server="svc", operation_id="undo",
                            idempotency_key="k", arguments_digest="d", duration_ms=1.0, worker="w", error="boom",
                            retryable=False)
carriers, kinds = [], []
with tracing.attempt(job) as lean:
    lean.outcome(failed)
    carriers.append(lean.carrier)
    kinds.append(type(lean.span).__name__)

started = []
class Starts(SpanProcessor):
    def on_start(self, span, parent_context=None):
        started.append(span.name)

trace.get_tracer_provider().add_span_processor(Starts())
with tracing.attempt(job) as sdk:
    sdk.outcome(failed)
    carriers.append(sdk.carrier)
    kinds.append(type(sdk.span).__name__)
tracing.shutdown()
print(json.dumps({"carriers": carriers, "started": started, "kinds": kinds}))
"""


def test_the_worker_span_made_without_the_sdk_span_exports_as_the_sdk_span(tmp_path: Path) -> None:
    """The usual configuration's attempt span skips the SDK's `Span` (runtime/tracing.py `_Lean`);
    a processor that watches spans start makes it go the SDK's way: both export the same span."""
    out, (lean, sdk) = _script_spans(SAME_SPAN, tmp_path)
    assert out["kinds"] == ["_LeanSpan", "_Span"]
    assert out["started"] == ["saga compensation undo"]  # the second attempt's start, the SDK's span
    for span, carrier in zip((lean, sdk), out["carriers"], strict=True):
        span_id = span["context"].pop("span_id").removeprefix("0x")
        # The parent's random-trace-id flag (02) is kept, as the SDK keeps it; the state passes on.
        assert carrier == {"traceparent": f"00-{'ab' * 16}-{span_id}-03", "tracestate": "vendor=x"}
        assert span.pop("start_time") <= span.pop("end_time")
    assert lean == sdk
    assert lean["status"] == {"status_code": "ERROR", "description": "boom"}
    assert lean["attributes"]["saga.attempt"] == 2 and lean["parent_id"] == "0x" + "cd" * 8


SAME_TRANSITION = """
import json
from types import SimpleNamespace
from mcp_saga.runtime import tracing
from mcp_saga.schemas.records import CompensationJob
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor

assert tracing.setup("coordinator")
parent = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-03", "tracestate": "vendor=x"}

def transition():
    job = CompensationJob(workflow="wf", step="s1", server="svc", tool="do", operation_id="undo", arguments={},
                          idempotency_key="k", dispatch=1)
    view = SimpleNamespace(workflow="wf", jobs=[job], loaded_status="running", state=SimpleNamespace(status="failed"))
    traces = tracing.BatchTraces()
    traces["wf"] = parent
    for span in tracing.begin_transitions([view], traces, 1_700_000_000.25).values():
        span.end()
    return view.jobs[0].trace

sdk_spans = []  # the spans the SDK's tracer was asked for
tracer = tracing._tracer()
sdk_start = tracer.start_span
tracer.start_span = lambda name, *args, **kwargs: sdk_spans.append(name) or sdk_start(name, *args, **kwargs)
carriers = [transition()]
started = []
class Starts(SpanProcessor):
    def on_start(self, span, parent_context=None):
        started.append(span.name)

trace.get_tracer_provider().add_span_processor(Starts())
carriers.append(transition())
tracing.shutdown()
print(json.dumps({"carriers": carriers, "started": started, "sdk_spans": sdk_spans}))
"""


def test_the_transition_span_made_without_the_sdk_span_exports_as_the_sdk_span(tmp_path: Path) -> None:
    """The coordinator's transition span skips the SDK's `Span` too (`_Lean`), started at its batch's
    start; a processor that watches spans start makes it go the SDK's way: both export the same span."""
    out, (lean, sdk) = _script_spans(SAME_TRANSITION, tmp_path)
    assert out["sdk_spans"] == ["saga transition"]  # only the second transition's span went the SDK's way
    assert out["started"] == ["saga transition"]
    for span, carrier in zip((lean, sdk), out["carriers"], strict=True):
        span_id = span["context"].pop("span_id").removeprefix("0x")
        assert carrier == {"traceparent": f"00-{'ab' * 16}-{span_id}-03", "tracestate": "vendor=x"}
        assert span.pop("end_time") >= span["start_time"]
    assert lean == sdk
    assert lean["kind"] == "SpanKind.INTERNAL" and lean["start_time"] == sdk["start_time"]
    assert lean["attributes"] == {
        "saga.workflow": "wf", "saga.status.from": "running", "saga.status.to": "failed", "saga.jobs": 1,
    }  # fmt: skip


HAND_OVER = """
import json, os, time
from mcp_saga.runtime import tracing
from mcp_saga.schemas.records import CompensationJob
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

assert tracing.setup("worker")
job = CompensationJob(workflow="wf", step="s1", server="svc", tool="do", operation_id="undo", arguments={},
                      idempotency_key="k", dispatch=1, trace={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
ends = []
class Ends(SpanProcessor):
    def on_end(self, span):
        ends.append(span.name)
trace.get_tracer_provider().add_span_processor(Ends())
out = {}
def attempts(n):
    for _ in range(n):
        with tracing.attempt(job):
            pass
attempts(tracing.HAND_OVER_AT - 1)
out["before_the_batch"] = len(ends)
attempts(1)
out["at_the_batch"] = len(ends)
attempts(3)
out["held"] = len(ends)
deadline = time.monotonic() + 10 * tracing.HAND_OVER_AFTER  # a bounded wait, not a timing check
while len(ends) == out["held"] and time.monotonic() < deadline:  # a quiet process's last spans
    time.sleep(0.05)
out["after_a_wait"] = len(ends)
attempts(1)
pid = os.fork()
if pid == 0:  # a child (RQ's scheduler, say) must not hand its parent's held spans over again
    trace.get_tracer_provider().force_flush()
    os._exit(7 if len(ends) != out["after_a_wait"] else 0)
out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
trace.get_tracer_provider().force_flush()
out["flushed"] = len(ends)
memory = InMemorySpanExporter()
trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(memory))
attempts(1)  # a processor that exports as each span ends: nothing is held back from it
out["simple"] = [len(memory.get_finished_spans()), len(ends)]
os._exit(print(json.dumps(out), flush=True) or 0)  # no shutdown: what was exported came without one
"""


def test_ended_attempt_spans_reach_the_processors_in_batches_and_none_waits_long(tmp_path: Path) -> None:
    """The worker's attempt spans are handed to the processors `HAND_OVER_AT` at a time (runtime/tracing.py
    `_Lean`), but never held past `HAND_OVER_AFTER`, a flush, a fork, or a processor that exports at once."""
    from mcp_saga.runtime.tracing import HAND_OVER_AT

    out, spans = _script_spans(HAND_OVER, tmp_path)
    assert out["before_the_batch"] == 0
    assert out["at_the_batch"] == HAND_OVER_AT
    assert out["held"] == HAND_OVER_AT
    assert out["after_a_wait"] == HAND_OVER_AT + 3
    assert out["child"] == 0
    assert out["flushed"] == HAND_OVER_AT + 4
    assert out["simple"] == [1, HAND_OVER_AT + 5]
    # The batch processor exported every one of them (the flush), none twice (the child's flush).
    assert len([s for s in spans if s["name"] == "saga compensation undo"]) in (HAND_OVER_AT + 4, HAND_OVER_AT + 5)
