"""What metrics and tracing cost: ingest and worker throughput with them on and off, in the same run.

    python -m bench.observability [--workflows 500] [--steps 10] [--jobs 300] [--rounds 9]
                                  [--worker-rounds 24] [--turns 12] [--block 10]
                                  [--parts ingest,attempt,worker]

"Off" replaces the hooks in the coordinator, the worker and the session pool with no-ops, so it
is the code without instrumentation; "on" is what production runs with both on: every counter and
histogram, a `/metrics` endpoint, and OpenTelemetry exporting every span (no sampling) over
OTLP/HTTP to a local stand-in for a collector that answers 200 to each batch (encoding and
sending are paid; a collector's own work is not).

On a shared 2-core box, two runs of the same code differ by 10-30% in wall-clock rate and by
5-15% in CPU time, so every part runs its modes in interleaved rounds (off, on, off again, in an
order that rotates from round to round) and judges the median of the per-round ratios, printed
with their quartiles; "off again" is an A/A row: the ratio of two runs of the same code, the
noise floor of the figure. CPU time is the primary figure (it moves less than rates when other
work shares the cores).

(a) ingest: one in-process coordinator drains `--workflows` x `--steps` step-completed events
    (each with a trace context) of which one workflow in five then fails, so the batches hold
    transitions (a span each) and dispatches too: its CPU per event, and events/s.
(b) a worker's compensation attempt run in-process without RQ (so RQ's share, about half a
    job's CPU, is not there to dilute it): its CPU, with every attempt traced and with 1 in 10;
    and the hooks alone (one attempt's span, exported and flushed, its metrics), as a share.
(c) one worker process (one slot) over streamable HTTP, every job carrying a trace context, its
    jobs in blocks of `--block` that take turns at off, on and off again; a round's figure per
    mode is the mean over its `--turns` turns (`--worker-rounds` rounds, two turns of warm-up left
    out): its CPU per compensation, measured inside it, and compensations/s. Separate processes
    per mode drifted apart as far as the effect.
Target (issue 17: "at most 5% of ingest and of worker throughput"): on / off <= 1/0.95 for CPU,
>= 0.95 for rates, in (a) and (c). The rows of (b) have no target: they are the same instrumentation
as (c)'s, measured where little else runs (no RQ), to see what it is made of; against an attempt
without RQ's half of a job, the same microseconds are a share twice as large as the one a worker
pays. `--parts` runs some of the parts only.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mcp_saga.cli.procs import REPO, free_port, start_http_server, stop, wait_until_accepting
from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.coordinator import consumer
from mcp_saga.examples import TRIVIAL
from mcp_saga.schemas.config import Config, ServerConfig, WorkerSettings, parse_config, write_config
from mcp_saga.schemas.events import TraceContext, WorkflowFailed, entry_fields
from redis import Redis
from redis.retry import Retry

from bench import coordinator as ingest
from bench import worker as work
from bench.table import Row, print_table

TARGET = 0.95


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every batch and keeps nothing.

    HTTP/1.1, so the exporter keeps its connection as it does with a real collector: with the
    handler's default HTTP/1.0, every batch paid a new connection, 2-3 ms of the exporter's CPU.
    """

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@contextmanager
def collector() -> Iterator[dict[str, str]]:
    """The OTEL_* variables of a process exporting to the stand-in collector.

    The collector runs in a process of its own, as a real one would: in this one, its reading of
    each batch would count in the CPU that the in-process rows charge to the worker's attempts.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.observability", "--collector", str(port)], cwd=REPO)
    try:
        wait_until_accepting("127.0.0.1", port, proc)
        yield {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    finally:
        stop(proc)


def serve_collector(port: int) -> int:
    ThreadingHTTPServer(("127.0.0.1", port), _Collector).serve_forever()
    return 0


def _trace(sampled: bool = True) -> TraceContext:
    return TraceContext(traceparent=f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}")


def workload(workflows: int, steps: int) -> list[dict[str, bytes | str]]:
    """bench/coordinator.py's steps with a trace context each, then a failure for one workflow in five."""
    import msgspec

    names = [f"order-{w:05d}" for w in range(workflows)]
    entries = [
        entry_fields(wf, msgspec.structs.replace(ingest.step_event(wf, n), trace=_trace()))
        for n in range(steps)
        for wf in names
    ]
    entries += [
        entry_fields(wf, WorkflowFailed(reason="bench", steps_completed=steps, trace=_trace())) for wf in names[::5]
    ]
    return entries


# No-op hooks ---------------------------------------------------------------------------------


def _noop(*_: Any, **__: Any) -> None:
    return None


OFF_METRICS = SimpleNamespace(
    observe_batch=_noop,
    transitions=_noop,
    dispatched=_noop,
    heartbeat=_noop,
    reported=_noop,
    REDIS_ERRORS=None,
    REDIS_RECONNECTS=None,
)
OFF_TRACING = SimpleNamespace(
    event_traces=lambda *_: {},
    begin_transitions=lambda *_: {},
    attempt=lambda *_: nullcontext(),
    continued=lambda *_: nullcontext(),
    sdk_spans=lambda: False,
)


@contextmanager
def instrumentation_off() -> Iterator[None]:
    saved = consumer.metrics, consumer.tracing
    consumer.metrics, consumer.tracing = OFF_METRICS, OFF_TRACING  # type: ignore[assignment]
    try:
        yield
    finally:
        consumer.metrics, consumer.tracing = saved


def tracing_on(environ: dict[str, str]) -> None:
    """This process's tracer provider, as `saga worker` sets it up from these variables.

    The worker's, since (c) runs attempts in this process: it leaves the MCP SDK's own request spans
    out. The coordinator's drains of (a) send no MCP request, so it is theirs as well.
    """
    from mcp_saga.runtime import tracing

    os.environ.update(environ)
    tracing.setup("worker")


Runs = dict[str, list[float]]


def order(modes: tuple[str, ...] | list[str], round_: int) -> list[str]:
    """The modes' order in a round: rotated every other round and reversed in every other one, so
    that each mode comes first as often as the others and follows each of them as often.

    Rotation alone always ran "off again" right after "on" and never "off": whatever "on" leaves
    behind for the next work (its spans to collect, caches it filled) fell on the A/A's side."""
    k = (round_ // 2) % len(modes)
    rotated = [*modes[k:], *modes[:k]]
    return rotated[::-1] if round_ % 2 else rotated


def interleaved(measures: dict[str, Any], rounds: int) -> Runs:
    """Each mode's figure per round, the modes in the `order` of the round."""
    modes = list(measures)
    runs: Runs = {mode: [] for mode in modes}
    for i in range(rounds):
        for mode in order(modes, i):
            runs[mode].append(measures[mode]())
    return runs


def compared(
    name: str, runs: Runs, mode: str, base: str, target: str, higher_is_better: bool = False, of_medians: bool = False
) -> Row:
    """A row of `mode` against `base` measured in the same rounds: the median of the per-round
    ratios and their quartiles (or, `of_medians`, the ratio of the two medians)."""
    ratios = [b / a for a, b in zip(runs[base], runs[mode], strict=True) if a]
    value, baseline = statistics.median(runs[mode]), statistics.median(runs[base])
    ratio = value / baseline if of_medians else statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratio, ratio, ratio)
    met = None
    if target:
        met = ratio >= TARGET if higher_is_better else ratio <= 1 / TARGET
    return Row(name, value, baseline, target, met, paired=ratio, spread=(q1, q3))


def base_row(name: str, runs: Runs, mode: str) -> Row:
    return Row(name, statistics.median(runs[mode]), None, "", None)


def difference(name: str, runs: Runs, mode: str, base: str, again: str = "again") -> Row:
    """What `mode` adds to `base` in absolute terms: the median of the per-round differences (the
    ratio column: their quartiles, in the same unit), beside the A/A's (`again` minus `base`)."""
    added = [b - a for a, b in zip(runs[base], runs[mode], strict=True)]
    noise = statistics.median(b - a for a, b in zip(runs[base], runs[again], strict=True))
    q1, _, q3 = statistics.quantiles(added, n=4) if len(added) > 1 else (added[0], added[0], added[0])
    return Row(f"{name}; the A/A's: {noise:+.0f}", statistics.median(added), None, "", None, spread=(q1, q3))


class Exporting:
    """The span exporter's CPU, kept out of the rounds and charged back to them per span.

    The SDK's batch processor exports in its own thread every 5 s or 512 spans; a round lasts
    less, so its export lands in whichever round runs then, often another mode's. Flushing at
    the end of each round would charge the right round but post batches of a few dozen spans,
    each paying the POST (about 1.8 ms here) that production spreads over 512. So the exporter
    thread's CPU clock is read apart, and each round is charged the run's export CPU per span
    times the spans it made (counted by a span processor of the bench's own).
    """

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanProcessor

        counts = self

        class Counting(SpanProcessor):
            def on_end(self, span: Any) -> None:
                counts.spans += 1

        self.spans = 0
        self.provider = trace.get_tracer_provider()
        self.provider.add_span_processor(Counting())  # type: ignore[attr-defined]

    def cpu(self) -> float:
        """The exporter threads' CPU seconds so far."""
        return sum(
            time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            for thread in threading.enumerate()
            if thread.name.startswith("OtelBatchSpan") and thread.ident is not None
        )

    @contextmanager
    def charged(self, rounds: Runs, spans: Runs) -> Iterator[None]:
        """Within: rounds record CPU without the exporter's and `spans` the spans each made; after:
        each round's figure gains its spans' share of the export CPU (in microseconds per unit)."""
        self.provider.force_flush()  # type: ignore[attr-defined]
        cpu, made = self.cpu(), self.spans
        yield
        self.provider.force_flush()  # type: ignore[attr-defined]
        per_span = (self.cpu() - cpu) * 1e6 / max(1, self.spans - made)
        for mode, figures in rounds.items():
            figures[:] = [f + per_span * n for f, n in zip(figures, spans[mode], strict=True)]

    @contextmanager
    def counted(self, spans: list[float], units: int) -> Iterator[None]:
        """One round: notes its spans per unit (event, attempt) in `spans`."""
        made = self.spans
        yield
        spans.append((self.spans - made) / units)


def drain(
    redis: Redis, entries: list[dict[str, bytes | str]], off: bool, exporting: Exporting | None = None
) -> tuple[float, float]:
    """(events/s, this process's CPU microseconds per event, the span exporter's left out) of one drain."""
    config = parse_config({"prefix": ingest.PREFIX, "coordinator": {"block_ms": 5}})
    with instrumentation_off() if off else nullcontext():
        started = time.process_time() - (exporting.cpu() if exporting else 0.0)
        rate = ingest.coordinator_drain(redis, entries, config)
        spent = time.process_time() - (exporting.cpu() if exporting else 0.0) - started
        return rate, spent / len(entries) * 1e6


def ingest_rows(url: str, workflows: int, steps: int, rounds: int) -> list[Row]:
    from mcp_saga.runtime import metrics

    server = metrics.serve(parse_config({}).metrics, "bench", port=free_port())
    redis = Redis.from_url(url)
    rates: Runs = {"off": [], "on": [], "again": []}
    try:
        entries = workload(workflows, steps)
        drain(redis, entries, off=False)  # a warm-up, not counted: the first drain of a run is the fastest

        exporting = Exporting()
        spans: Runs = {mode: [] for mode in rates}

        def measure(mode: str) -> Any:
            def one() -> float:
                with exporting.counted(spans[mode], len(entries)):
                    rate, cpu = drain(redis, entries, mode != "on", exporting)
                rates[mode].append(rate)
                return cpu

            return one

        cpu: Runs = {}
        with exporting.charged(cpu, spans):
            cpu.update(interleaved({mode: measure(mode) for mode in rates}, rounds))
        ingest.clean(redis)
    finally:
        redis.close()
        if server is not None:
            server.close()
    limit = f"<= {1 / TARGET:.2f}"
    return [
        base_row("ingest, coordinator CPU per event, off (us)", cpu, "off"),
        compared("ingest, CPU per event, off again: the noise (us)", cpu, "again", "off", ""),
        compared("ingest, CPU per event, metrics + tracing on (us)", cpu, "on", "off", limit),
        difference("ingest, CPU per event, on minus off (us)", cpu, "on", "off"),
        base_row("ingest, instrumentation off (events/s)", rates, "off"),
        compared("ingest, events/s, off again: the noise", rates, "again", "off", "", True),
        compared("ingest, metrics + tracing on (events/s)", rates, "on", "off", f">= {TARGET}", True),
    ]


MODES = ("off", "on", "again")


TURNS = 12  # a worker round's turns: each of `order`'s six orders twice


def mode_of(block: int) -> str:
    """The mode of the `block`-th block of jobs: turns of three blocks, in the `order` of their turn."""
    return order(MODES, block // len(MODES))[block % len(MODES)]


def worker_rows(url: str, rounds: int, block: int, warm: int, otel: dict[str, str], turns: int = TURNS) -> list[Row]:
    """One worker process whose jobs take turns, in blocks of `block`, at off, on and off again.

    Separate processes per mode (one per round) gave an A/A as far from 1 as the effect: the load
    moved between processes seconds apart. Here the modes alternate every tenth of a second or so in
    one process, which measures each job's CPU (see `worker_process`); `warm` turns are left out.

    A round is `turns` turns, and its figure per mode is the mean over its blocks: the CPU of one
    job moves by a fifth from one job to the next on this box, and slowly (successive jobs
    correlate at 0.85, ten jobs apart still at 0.6), so that a round of one turn, ten jobs a mode,
    gave per-round ratios with quartiles 8-10% apart, the A/A's as wide as the effect. Short
    blocks keep the modes side by side within the drift; the mean of many of them per round
    averages out the rest (quartiles 2.5% apart at twelve turns on a quiet box, 4-8% on a busy
    one), and the round's ratio is then one of totals, as a job's cost is.
    """
    this = [sys.executable, "-m", "bench.observability", "--worker-process"]
    carrier = {"traceparent": _trace().traceparent}
    jobs = (rounds * turns + warm) * len(MODES) * block
    with ExitStack() as stack:
        target = stack.enter_context(start_http_server(TRIVIAL))[1]
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        config, cpu_file = folder / "bench.toml", folder / "cpu.json"
        servers = {"trivial": ServerConfig(url=target)}
        one_slot = Config(prefix=work.PREFIX, servers=servers, worker=WorkerSettings(concurrency=1))
        write_config(one_slot, config)
        redis = Redis.from_url(url)
        command = [*this, str(block), str(cpu_file)]
        work.run_workers(redis, url, config, jobs, 1, command=command, trace=carrier, env=otel, sample=False)
        redis.flushdb()
        redis.close()
        measured = json.loads(cpu_file.read_text())
    assert not any(spans for _, mode, *_, spans in measured["blocks"] if mode != "on"), "a span with the hooks off"
    cpu, rates = per_round(measured["blocks"], measured["export_us_per_span"], block, warm, turns)
    limit = f"<= {1 / TARGET:.2f}"
    return [
        base_row("worker process, CPU per compensation, off (us)", cpu, "off"),
        compared("worker process, CPU per compensation, off again: the noise (us)", cpu, "again", "off", ""),
        compared("worker process, CPU per compensation, on (us)", cpu, "on", "off", limit),
        difference("worker process, CPU per compensation, on minus off (us)", cpu, "on", "off"),
        Row("worker process, of which the span's export (us)", measured["export_us_per_span"], None, "", None),
        base_row("worker process, instrumentation off (compensations/s)", rates, "off"),
        compared("worker process, compensations/s, off again: the noise", rates, "again", "off", "", True),
        compared("worker process, on (compensations/s)", rates, "on", "off", f">= {TARGET}", True),
    ]


def per_round(
    blocks: list[list[Any]], export_us_per_span: float, block: int, warm: int, turns: int
) -> tuple[Runs, Runs]:
    """Each mode's CPU per job (its spans' export charged back) and jobs/s, per round of `turns`
    turns after the `warm` ones: whole turns only, so that a round's three modes pair up."""
    cpu: Runs = {mode: [] for mode in MODES}
    rates: Runs = {mode: [] for mode in MODES}
    spent: dict[tuple[int, str], list[float]] = {}
    for n, mode, us, seconds, spans in blocks:
        turn = n // len(MODES) - warm
        if turn >= 0:
            figures = spent.setdefault((turn // turns, mode), [0.0, 0.0, 0])
            figures[0] += us + export_us_per_span * spans / block
            figures[1] += seconds
            figures[2] += 1
    for (_, mode), (us, seconds, count) in sorted(spent.items()):
        if count == turns:
            cpu[mode].append(us / count)
            rates[mode].append(block * count / seconds)
    assert len({len(figures) for figures in cpu.values()}) == 1, "a round without all of its blocks"
    return cpu, rates


class WorkerHooks:
    """Switches a worker's instrumentation: the job's and the session pool's hooks, and the metrics'
    Redis retry (which counts errors) for redis-py's own."""

    def __init__(self) -> None:
        from mcp_saga.runtime import metrics, sessions
        from mcp_saga.workers import job

        self.job, self.sessions, self.retry = job, sessions, metrics.CountingRetry
        self.real = job.metrics, job.tracing, sessions.tracing, metrics.CountingRetry.call_with_retry

    def set(self, on: bool) -> None:
        hooks = self.real if on else (OFF_METRICS, OFF_TRACING, OFF_TRACING, Retry.call_with_retry)
        self.job.metrics, self.job.tracing, self.sessions.tracing, self.retry.call_with_retry = hooks


@contextmanager
def worker_hooks_off() -> Iterator[None]:
    hooks = WorkerHooks()
    hooks.set(False)
    try:
        yield
    finally:
        hooks.set(True)


def attempt_cpu_rows(url: str, jobs: int, rounds: int) -> list[Row]:
    """CPU time of this process per compensation attempt, run in-process without RQ.

    The CPU the attempt costs this process (its threads included: the session loop, the span
    exporter) in short rounds of `per` attempts per mode. RQ's own CPU (about 3 ms a job) is left
    out, so the ratios overstate the cost.

    The last row measures the hooks alone, free of the MCP call's noise: what one attempt's
    instrumentation (its span and its export; its `_meta` context; its metrics) costs in a loop
    that does nothing else, on minus off in the same round, as a share of that round's attempt
    with the hooks off. The exporter's CPU is charged per span (see `Exporting`).
    """
    import msgspec
    from mcp_saga.runtime.sessions import SessionPool
    from mcp_saga.schemas.events import CompensationSucceeded
    from mcp_saga.workers import job

    carrier = {"traceparent": _trace().traceparent}
    per = max(20, jobs // 4)
    with start_http_server(TRIVIAL) as (_, target):
        config = parse_config({"prefix": work.PREFIX, "servers": {"trivial": {"url": target}}})
        redis = Redis.from_url(url)
        redis.flushdb()
        pool = SessionPool(config.servers, tools_ttl=30)
        context = job.WorkerContext(redis, config, pool, "bench")
        first = 0

        def planted(count: int, sampled: float = 1.0) -> list[Any]:
            nonlocal first
            jobs_ = work.plant(redis, count, carrier, first)
            first += count
            if sampled < 1:  # the agent's sampler traced this share of workflows; the rest carry flag 00
                every = round(1 / sampled)
                jobs_ = [
                    msgspec.structs.replace(j, trace={"traceparent": _trace(i % every == 0).traceparent})
                    for i, j in enumerate(jobs_)
                ]
            return jobs_

        exporting = Exporting()
        modes = ("off", "on", "tenth", "again", "hooks-on", "hooks-off")
        spans: Runs = {mode: [] for mode in modes}

        def measure(mode: str) -> Any:
            def one() -> float:
                batch = planted(per, 0.1 if mode == "tenth" else 1.0)
                hooks_off = worker_hooks_off() if mode in ("off", "again") else nullcontext()
                with hooks_off, exporting.counted(spans[mode], per):
                    started = time.process_time() - exporting.cpu()
                    for each in batch:
                        outbox = job.Outbox(context.redis)  # the report, sent as a job without RQ sends it
                        job._Attempt(context, each, None, outbox=outbox).run()
                        outbox.flush()
                    return (time.process_time() - exporting.cpu() - started) / per * 1e6

            return one

        report = CompensationSucceeded(
            step="s", dispatch=1, attempt=1, final=True, server="trivial", operation_id="noop_undo",
            idempotency_key="k", arguments_digest="d", duration_ms=1.0, worker="bench", result={},
        )  # fmt: skip
        batch = planted(jobs)

        def hooks(off: bool) -> Any:
            def one() -> float:
                mode = "hooks-off" if off else "hooks-on"
                with worker_hooks_off() if off else nullcontext(), exporting.counted(spans[mode], len(batch)):
                    started = time.process_time() - exporting.cpu()
                    for each in batch:
                        with job.tracing.attempt(each) as traced:
                            meta = traced.carrier if traced is not None else {}
                            with job.tracing.continued(meta):
                                job.metrics.reported(report)
                            if traced is not None:
                                traced.wire()
                                traced.outcome(report)
                    return (time.process_time() - exporting.cpu() - started) / len(batch) * 1e6

            return one

        try:
            measure("on")()  # warm: the session, the tools/list cache
            spans["on"].clear()
            calls = [measure(m) for m in modes[:4]] + [hooks(off=False), hooks(off=True)]
            runs: Runs = {}
            with exporting.charged(runs, spans):
                runs.update(interleaved(dict(zip(modes, calls, strict=True)), rounds))
        finally:
            pool.close()
            redis.flushdb()
            redis.close()
    runs["hooks"] = [on - off for on, off in zip(runs["hooks-on"], runs["hooks-off"], strict=True)]
    shares = [own / base for own, base in zip(runs["hooks"], runs["off"], strict=True)]
    share = statistics.median(shares)
    q1, _, q3 = statistics.quantiles(shares, n=4)
    return [  # diagnostics, no target: see the module's docstring
        base_row("worker attempt CPU, instrumentation off (us)", runs, "off"),
        compared("worker attempt CPU, off again: the noise (us)", runs, "again", "off", ""),
        compared("worker attempt CPU, metrics + tracing on (us)", runs, "on", "off", ""),
        difference("worker attempt CPU, on minus off (us)", runs, "on", "off"),
        compared("worker attempt CPU, on, 1 workflow in 10 traced (us)", runs, "tenth", "off", ""),
        Row(
            "worker attempt, the hooks' own CPU (us; share of one)",
            statistics.median(runs["hooks"]),
            statistics.median(runs["off"]),
            "",
            None,
            paired=share,
            spread=(q1, q3),
        ),
    ]


PARTS = ("ingest", "attempt", "worker")


def rows(
    url: str,
    *,
    workflows: int = 500,
    steps: int = 10,
    jobs: int = 300,
    rounds: int = 9,
    worker_rounds: int = 24,
    turns: int = TURNS,
    block: int = 10,
    parts: tuple[str, ...] = PARTS,
) -> list[Row]:
    rounds = max(2, rounds)
    found: list[Row] = []
    with collector() as otel:
        if "ingest" in parts or "attempt" in parts:
            tracing_on(otel)  # once: both run in this process
        if "ingest" in parts:
            found += ingest_rows(url, workflows, steps, rounds)
        if "attempt" in parts:
            found += attempt_cpu_rows(url, jobs, rounds * 2)
        if "worker" in parts:
            found += worker_rows(url, max(2, worker_rounds), block, 2, otel, max(1, turns))
    return found


def worker_process(block: int, cpu_file: str, argv: list[str]) -> int:
    """`python -m mcp_saga.workers` with tracing and a metrics endpoint on, its jobs' hooks switched
    off and on by blocks of `block` jobs (`mode_of`); one slot, so one job runs at a time.

    Writes to `cpu_file`, per block: its mode, its CPU per job (the process's, from the end of the
    block before to the end of its last job, RQ's work between the jobs included, the span
    exporter's thread left out), its seconds, and its spans; and the exporter's CPU per span over
    the run (its last flush included), which the caller charges back per span (see `Exporting`).
    """
    from mcp_saga.runtime import metrics, tracing
    from mcp_saga.workers import __main__ as entry
    from mcp_saga.workers import job

    tracing.setup("worker")
    metrics.serve(parse_config({}).metrics, "worker", port=free_port())
    exporting, hooks = Exporting(), WorkerHooks()
    ends: list[tuple[str, float, float, int]] = []
    compensate = job.compensate

    def counted(payload: str) -> str:  # RQ finds the job's function by name, so this is what it runs
        mode = mode_of(len(ends) // block)
        hooks.set(mode == "on")
        try:
            return compensate(payload)
        finally:
            ends.append((mode, time.process_time() - exporting.cpu(), time.perf_counter(), exporting.spans))

    job.compensate = counted  # type: ignore[assignment]
    try:
        return entry.main(argv)
    finally:
        hooks.set(True)
        exporting.provider.force_flush()  # type: ignore[attr-defined]
        per_span = exporting.cpu() * 1e6 / max(1, exporting.spans)  # before the shutdown ends its thread
        tracing.shutdown()
        blocks = []
        for n in range(1, len(ends) // block):  # the first block has no end before it
            first, last = ends[n * block - 1], ends[(n + 1) * block - 1]
            spent = (last[1] - first[1]) * 1e6 / block
            blocks.append((n, last[0], spent, last[2] - first[2], last[3] - first[3]))
        Path(cpu_file).write_text(json.dumps({"blocks": blocks, "export_us_per_span": per_span}))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker-process"]:
        return worker_process(int(argv[1]), argv[2], argv[3:])
    if argv[:1] == ["--collector"]:
        return serve_collector(int(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=500)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=300, help="attempts per in-process round (a quarter of it)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds of ingest (the attempts: twice)")
    parser.add_argument("--worker-rounds", type=int, default=24, help="rounds of the worker process's turns")
    parser.add_argument("--turns", type=int, default=TURNS, help="turns (a block of each mode) per worker round")
    parser.add_argument("--block", type=int, default=10, help="jobs per block in the worker process")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = tuple(part.strip() for part in args.parts.split(",") if part.strip())
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))} (known: {', '.join(PARTS)})")
    with resolve_redis(None) as url:
        found = rows(
            url, workflows=args.workflows, steps=args.steps, jobs=args.jobs, rounds=args.rounds,
            worker_rounds=args.worker_rounds, turns=args.turns, block=args.block, parts=parts,
        )  # fmt: skip
    print_table(found, f"metrics and tracing: on vs off, same run, load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
