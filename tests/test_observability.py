"""Metrics, traces and log correlation, read from real processes during a real run.

One run serves every test here: two `saga coordinator`s and one `saga worker` (each with its
`/metrics` endpoint and OpenTelemetry exporting to a file), the example servers over streamable
HTTP (payments fails its first refund once, so one attempt is retried) and a test server that
writes down the `_meta` each compensating call brings. The test process is the agent: it runs
three workflows with the SDK under an in-memory tracer. The counts scraped are then checked
against what the run did, and the spans of all processes against one trace.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp import Client
from mcp_saga.examples import SERVERS
from mcp_saga.runtime import tracing
from mcp_saga.schemas.keys import Keys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once
from processes import free_port, saga_process, start_http_servers, stop, wait_for
from prometheus_client.parser import text_string_to_metric_families

import mcp_saga

# OpenTelemetry keeps the first tracer provider a process installs, so these run in a fresh
# interpreter of their own (tests/test_observability_isolated.py), not after the rest of the suite.
pytestmark = pytest.mark.skipif(
    __import__("os").environ.get("SAGA_OBSERVABILITY_ISOLATED") != "1",
    reason="run in its own interpreter by test_observability_isolated.py",
)

K = Keys()
SETTLE = 60.0  # seconds: a bound on waiting, never an assertion on speed
WORKFLOWS = {"obs-completed": "completed", "obs-shipping": "compensated", "obs-traced": "compensated"}


class Boom(Exception):
    pass


@dataclass
class Run:
    tmp: Path
    coordinators: list[str]  # metrics URLs
    worker: str
    agent_spans: list[Any]
    meta_log: Path
    r: redis.Redis

    def scrape(self, url: str, token: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def total(self, urls: list[str], name: str, **labels: str) -> float:
        """A sample summed over processes: what a `sum()` in PromQL would say."""
        found = 0.0
        for url in urls:
            for (sample, have), value in self.scrape(url).items():
                if sample == name and all(dict(have).get(k) == v for k, v in labels.items()):
                    found += value
        return found

    def spans(self) -> list[dict[str, Any]]:
        """Every span of the run as one shape: the agent's (in memory) and the processes' (JSON lines)."""
        found = [
            {
                "name": s.name,
                "trace": f"{s.context.trace_id:032x}",
                "span": f"{s.context.span_id:016x}",
                "parent": f"{s.parent.span_id:016x}" if s.parent else None,
                "attributes": dict(s.attributes or {}),
                "service": "agent",
                "kind": str(s.kind),
                "error": s.status.status_code.name == "ERROR",
            }
            for s in self.agent_spans
        ]
        for path in sorted(self.tmp.glob("spans-*.jsonl")):
            for line in path.read_text().splitlines():
                s = json.loads(line)
                found.append(
                    {
                        "name": s["name"],
                        "trace": s["context"]["trace_id"].removeprefix("0x"),
                        "span": s["context"]["span_id"].removeprefix("0x"),
                        "parent": s["parent_id"].removeprefix("0x") if s.get("parent_id") else None,
                        "attributes": s.get("attributes", {}),
                        "service": s["resource"]["attributes"]["service.name"],
                        "kind": s.get("kind"),
                        "error": s["status"]["status_code"] == "ERROR",
                    }
                )
        return found


def _config(path: Path, urls: dict[str, str]) -> Path:
    lines = []
    for name, url in urls.items():
        lines += [f"[servers.{name}]", f'url = "{url}"']
    lines += [
        "[worker]",
        "attempts = 3",
        "backoff_base = 0",
        "jitter = 0",
        "[coordinator]",
        "block_ms = 100",
        "[metrics]",
        "fleet_interval = 1",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@contextmanager
def agent_tracer() -> Iterator[InMemorySpanExporter]:
    """The agent's own OpenTelemetry set-up, for the length of the block.

    A process has one global provider, which OpenTelemetry lets no one replace; undoing it the way
    OpenTelemetry's own tests do keeps the SDK from tracing in the tests that run after these.
    """
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        provider.shutdown()
        trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
        trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]


async def _agent(urls: dict[str, str], redis_url: str) -> None:
    async with (
        Client(urls["inventory"]) as inventory,
        Client(urls["payments"]) as payments,
        Client(urls["shipping"]) as shipping,
        Client(urls["notes"]) as notes,
    ):
        servers = {"inventory": inventory, "payments": payments, "shipping": shipping, "notes": notes}
        async with mcp_saga.workflow("obs-completed", redis=redis_url, servers=servers) as wf:
            await wf.call("inventory", "reserve_inventory", {"sku": "W-1", "quantity": 1})
            await wf.call("payments", "charge_payment", {"orderId": "obs-completed", "amount": 5})
            await wf.call("shipping", "create_shipment", {"orderId": "obs-completed", "address": "1 Main St"})
        with pytest.raises(mcp_saga.ToolCallFailed):
            async with mcp_saga.workflow("obs-shipping", redis=redis_url, servers=servers) as wf:
                await wf.call("inventory", "reserve_inventory", {"sku": "W-2", "quantity": 1})
                await wf.call("payments", "charge_payment", {"orderId": "obs-shipping", "amount": 7})
                arguments = {"orderId": "obs-shipping", "address": "x", "simulateFailure": True}
                await wf.call("shipping", "create_shipment", arguments)
        with pytest.raises(Boom):
            async with mcp_saga.workflow("obs-traced", redis=redis_url, servers=servers) as wf:
                await wf.call("notes", "add_note", {"text": "remember the milk"})
                await wf.call("payments", "charge_payment", {"orderId": "obs-traced", "amount": 9})
                raise Boom("the agent changed its mind")


@pytest.fixture(scope="module")
def run(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("observability")
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    meta_log = tmp / "meta.jsonl"
    specs = [(module, "--db", str(tmp / f"{name}.db")) for name, module in SERVERS.items()]
    specs[list(SERVERS).index("payments")] += ("--fail-first", "1")
    specs.append(("tests.meta_server",))
    server_env = {
        "SAGA_TEST_META_LOG": str(meta_log),
        "OTEL_TRACES_EXPORTER": "console",
        "SAGA_TRACES_FILE": str(tmp / "spans-server.jsonl"),  # only the notes server traces
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    with agent_tracer() as exporter, start_http_servers(*specs, env=server_env) as started:
        urls = {name: url for name, (_, url) in zip([*SERVERS, "notes"], started, strict=True)}
        config = _config(tmp / "saga.toml", urls)
        procs, ports = [], []
        try:
            for i, kind in enumerate(["coordinator", "coordinator", "worker"]):
                ports.append(free_port())
                env = {
                    "OTEL_TRACES_EXPORTER": "console",
                    "SAGA_TRACES_FILE": str(tmp / f"spans-{kind}-{i}.jsonl"),
                    "OTEL_BSP_SCHEDULE_DELAY": "100",
                }
                args = [kind, "--name", f"{kind}-{i}", "--metrics-port", str(ports[-1])]
                procs.append(
                    saga_process(*args, redis_url=redis_url, config=config, env=env, log=tmp / f"{kind}-{i}.log")
                )
            metrics_urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]
            run = Run(tmp, metrics_urls[:2], metrics_urls[2], [], meta_log, r)
            for url in metrics_urls:
                wait_for(lambda url=url: _answers(url), SETTLE, f"{url} to answer")
            asyncio.run(_agent(urls, redis_url))
            r.xadd(K.events, {"type": "nonsense", "workflow": "obs-x", "data": "{}"})
            r.xadd(K.events, {"type": "workflow-completed", "workflow": "not a valid id!", "data": "{}"})
            for workflow, status in WORKFLOWS.items():
                wait_for(
                    lambda w=workflow, s=status: r.hget(K.state(w), "status") == s.encode(),
                    SETTLE,
                    f"{workflow} {status}",
                )
            wait_for(lambda: r.xlen(K.dead_letter) == 2, SETTLE, "the dead letters")
            # The processes export their spans in batches, every 100 ms here, and hand their own
            # spans to the batch processor up to a fifth of that later: the last may still be on their way.
            wait_for(_spans_settled(tmp), SETTLE, "the processes' spans to be exported")
            run.agent_spans = list(exporter.get_finished_spans())
            yield run
        finally:
            for proc in procs:
                stop(proc)
            r.flushdb()
            r.close()


def _spans_settled(tmp: Path) -> Callable[[], bool]:
    """True once the span files have not grown for half a second (five export rounds here)."""
    sizes: list[int] = []

    def settled() -> bool:
        sizes.append(sum(path.stat().st_size for path in tmp.glob("spans-*.jsonl")))
        return sizes[-1] > 0 and len(sizes) >= 10 and len(set(sizes[-10:])) == 1

    return settled


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def test_counters_of_the_coordinators_add_up_to_what_happened(run: Run) -> None:
    c = run.coordinators
    # Eight calls, each announced; seven completed, and the error answer of the eighth settles its intent.
    assert run.total(c, "saga_events_consumed_total", type="step-started") == 8
    assert run.total(c, "saga_events_consumed_total", type="step-completed") == 8
    assert run.total(c, "saga_events_consumed_total", type="workflow-failed") == 2
    assert run.total(c, "saga_events_consumed_total", type="workflow-completed") == 2  # one of them is malformed
    assert run.total(c, "saga_events_consumed_total", type="invalid") == 1
    assert run.total(c, "saga_events_consumed_total", type="compensation-succeeded") == 4
    assert run.total(c, "saga_events_consumed_total", type="compensation-failed") == 1  # the retried refund
    assert run.total(c, "saga_dead_letters_total", reason="unknown-type") == 1
    assert run.total(c, "saga_dead_letters_total", reason="invalid-id") == 1
    # Every workflow was created once and reached its end once, whichever path the batches took.
    assert run.total(c, "saga_workflow_transitions_total", **{"from": "new"}) == 3
    assert run.total(c, "saga_workflow_transitions_total", to="compensated") == 2
    assert run.total(c, "saga_workflow_transitions_total", to="completed") == 1
    assert run.total(c, "saga_workflow_settle_seconds_count", status="compensated") == 2
    assert run.total(c, "saga_workflow_settle_seconds_count", status="completed") == 1
    dispatched = "saga_compensations_dispatched_total"
    assert run.total(c, dispatched, server="payments", operation="refund_payment") == 2
    # The step below a refund rides in the refund's routing slip; the one slip whose refund took the
    # injected failure is taken back and that step dispatched again once the retried refund succeeded.
    # Which refund reaches payments first is a race (obs-shipping's and obs-traced's unwinds run in two
    # worker slots at once), so either step may be the one dispatched twice, never both.
    release = run.total(c, dispatched, server="inventory", operation="release_inventory")
    remove = run.total(c, dispatched, server="notes", operation="remove_note")
    assert release in (1, 2) and remove in (1, 2)
    assert (release - 1) + (remove - 1) <= 1, (release, remove)
    assert run.total(c, "saga_batch_duration_seconds_count") >= 1
    assert run.total(c, "saga_coordinator_heartbeat_timestamp_seconds") > 0


def test_the_worker_counts_attempts_outcomes_and_durations(run: Run) -> None:
    w, attempts = [run.worker], "saga_compensation_attempts_total"
    assert run.total(w, attempts, server="payments", operation="refund_payment", outcome="succeeded") == 2
    assert run.total(w, attempts, server="payments", operation="refund_payment", outcome="retrying") == 1
    assert run.total(w, attempts, server="inventory", operation="release_inventory", outcome="succeeded") == 1
    assert run.total(w, attempts, server="notes", operation="remove_note", outcome="succeeded") == 1
    assert run.total(w, attempts, outcome="failed") == 0
    assert run.total(w, "saga_compensation_attempts_used_count", outcome="succeeded") == 4
    assert run.total(w, "saga_compensation_attempts_used_sum", outcome="succeeded") == 5  # 1 + 1 + 1 + 2
    duration = "saga_compensation_attempt_duration_seconds_count"
    assert run.total(w, duration, server="payments", operation="refund_payment") == 3
    assert run.total(w, "saga_fleet_reader") == 0  # workers do not read the fleet gauges


def test_one_coordinator_exports_the_fleet_gauges(run: Run) -> None:
    def settled() -> list[dict]:
        scrapes = [run.scrape(url) for url in run.coordinators]
        readers = [s for s in scrapes if s.get(("saga_fleet_reader", ())) == 1]
        if len(readers) != 1 or readers[0].get(("saga_workflows", (("status", "compensated"),))) != 2:
            return []
        return readers

    (fleet,) = wait_for(settled, SETTLE, "one reader with the final counts")
    assert sum(s.get(("saga_fleet_reader", ()), 0) for s in (run.scrape(u) for u in run.coordinators)) == 1
    assert fleet[("saga_workflows", (("status", "completed"),))] == 1
    assert fleet[("saga_workflows", (("status", "running"),))] == 0
    assert fleet[("saga_consumer_group_pending", (("group", "coordinators"),))] == 0
    assert fleet[("saga_oldest_pending_age_seconds", (("group", "coordinators"),))] == 0
    assert fleet[("saga_consumer_group_consumers", (("group", "coordinators"),))] == 2
    assert fleet[("saga_queue_jobs", (("state", "queued"),))] == 0
    assert fleet[("saga_dead_letter_stream_length", ())] == 2


def test_one_trace_runs_from_the_agent_call_to_each_compensation_at_the_server(run: Run) -> None:
    spans = run.spans()
    (root,) = [s for s in spans if s["name"] == "saga workflow" and s["attributes"]["saga.workflow"] == "obs-traced"]
    assert root["error"]
    mine = {s["span"]: s for s in spans if s["trace"] == root["trace"]}
    calls = sorted(s["name"] for s in mine.values() if s["service"] == "agent" and s["parent"] == root["span"])
    assert calls == ["saga step add_note", "saga step charge_payment"]
    transitions = [s for s in mine.values() if s["name"] == "saga transition"]
    assert {s["service"] for s in transitions} == {"saga-coordinator"}
    # The failure's transition continues the workflow's span, which workflow-failed carried.
    (first,) = [s for s in transitions if s["parent"] == root["span"]]
    # `failed` when the failure arrived before the steps it announced were recorded (the barrier).
    assert first["attributes"]["saga.status.to"] in ("compensating", "failed")
    assert any(s["attributes"]["saga.status.to"] == "compensated" for s in transitions)
    compensations = [s for s in mine.values() if s["name"].startswith("saga compensation ")]
    assert {s["service"] for s in compensations} == {"saga-worker"}
    assert {s["name"] for s in compensations} == {"saga compensation refund_payment", "saga compensation remove_note"}
    for span in compensations:  # each attempt continues the transition that dispatched it
        assert mine[span["parent"]]["name"] == "saga transition"
        assert span["attributes"]["saga.workflow"] == "obs-traced"
    # The compensating tools/call carried the trace in its request `_meta`: the attempt's span is the
    # client span of that call (the worker leaves the MCP SDK's own out: one span per attempt), it is
    # the parent the server saw, and the server's span continues it.
    (remove,) = [s for s in compensations if s["name"] == "saga compensation remove_note"]
    assert remove["kind"] == "SpanKind.CLIENT"
    (arrived,) = [json.loads(line)["meta"] for line in run.meta_log.read_text().splitlines()]
    assert arrived["io.github.mcp-saga/idempotency-key"].startswith("saga:")
    _, trace_id, sent_by, _ = arrived["traceparent"].split("-")
    assert trace_id == root["trace"]
    assert sent_by == remove["span"]
    assert not [s for s in spans if s["service"] == "saga-worker" and s["name"].startswith("MCP send")]
    (served,) = [s for s in mine.values() if s["service"] == "saga-notes" and s["name"] == "tools/call remove_note"]
    assert served["parent"] == sent_by


def test_log_lines_of_a_traced_workflow_name_its_trace(run: Run) -> None:
    spans = run.spans()
    (root,) = [s for s in spans if s["name"] == "saga workflow" and s["attributes"]["saga.workflow"] == "obs-traced"]
    lines = [
        line
        for log in run.tmp.glob("*.log")
        for line in log.read_text().splitlines()
        if "workflow=obs-traced " in line + " " or line.endswith("workflow=obs-traced")
    ]
    assert lines
    worker_lines = [line for line in lines if " worker:" in line]
    assert worker_lines
    assert all(f"trace_id={root['trace']}" in line for line in worker_lines)
    # A coordinator names the trace from the first traced event of the workflow it handled on.
    traced = [line for line in lines if f"trace_id={root['trace']}" in line]
    assert any(" coordinator:" in line for line in traced)


def test_a_token_protects_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcp_saga.runtime import metrics
    from mcp_saga.schemas.config import MetricsSettings

    monkeypatch.setenv("SAGA_TEST_METRICS_TOKEN", "s3cret")
    server = metrics.serve(MetricsSettings(port=free_port(), token_env="SAGA_TEST_METRICS_TOKEN"), "test")
    assert server is not None
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 401
        request = urllib.request.Request(url, headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert b"saga_events_consumed_total" in response.read() or response.status == 200
    finally:
        server.close()


def test_tracing_is_off_without_otel_variables() -> None:
    assert not tracing.wanted({})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})


def test_a_front_end_reads_the_current_trace_for_its_events() -> None:
    """What the gateway puts in a step-completed: the context of the span it handles the call in."""
    with agent_tracer():
        assert tracing.current_trace() is None  # no span: nothing to carry
        with trace.get_tracer("test").start_as_current_span("tools/call charge") as span:
            carried = tracing.current_trace()
    assert not tracing.active()
    context = span.get_span_context()
    assert carried is not None
    assert carried.traceparent == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
