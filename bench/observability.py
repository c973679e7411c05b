"""What metrics and tracing cost: ingest and worker throughput with them on and off, in the same run.

    python -m bench.observability [--workflows 500] [--steps 10] [--jobs 600] [--repeat 3]

"Off" replaces the hooks in the coordinator, the worker and the session pool with no-ops, so it
is the code without instrumentation; "on" is what production runs with both on: every counter and
histogram, a `/metrics` endpoint, and OpenTelemetry exporting every span (no sampling) over
OTLP/HTTP to a local stand-in for a collector that answers 200 to each batch (encoding and
sending are paid; a collector's own work is not).

(a) ingest: one in-process coordinator drains `--workflows` x `--steps` step-completed events
    (each with a trace context) of which one workflow in five then fails, so the batches hold
    transitions (a span each) and dispatches too; on / off, each the median of `--repeat` drains
    taken in turns after one warm-up drain. Target: >= 0.95.
(b) worker: compensations/s of one worker process over streamable HTTP (bench/worker.py's
    method), jobs carrying a trace context; on / off, best of `--repeat`. Target: >= 0.95.
(c) the same as CPU time, steadier than rates when other work shares the cores: the
    coordinator's per event over (a)'s drains, and a worker's per compensation attempt run
    in-process without RQ (so RQ's share, about half a job's CPU, is not there to dilute it).
    Target: on / off <= 1/0.95.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
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
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import TraceContext, WorkflowFailed, entry_fields
from redis import Redis
from redis.retry import Retry

from bench import coordinator as ingest
from bench import worker as work
from bench.table import Row, print_table

TARGET = 0.95


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes every batch and keeps nothing."""

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
    transitions=_noop,
    attempt=lambda *_: nullcontext(),
    continued=lambda *_: nullcontext(),
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


def drain(redis: Redis, entries: list[dict[str, bytes | str]], off: bool) -> tuple[float, float]:
    """(events/s, this process's CPU microseconds per event) of one coordinator drain."""
    config = parse_config({"prefix": ingest.PREFIX, "coordinator": {"block_ms": 5}})
    with instrumentation_off() if off else nullcontext():
        started = time.process_time()
        rate = ingest.coordinator_drain(redis, entries, config)
        return rate, (time.process_time() - started) / len(entries) * 1e6


def ingest_rows(url: str, workflows: int, steps: int, repeat: int, otel: dict[str, str]) -> list[Row]:
    from mcp_saga.runtime import metrics

    tracing_on(otel)
    server = metrics.serve(parse_config({}).metrics, "bench", port=free_port())
    redis = Redis.from_url(url)
    try:
        entries = workload(workflows, steps)
        drain(redis, entries, off=False)  # a warm-up, not counted: the first drain of a run is the fastest
        off, on = [], []
        for _ in range(repeat):  # in turns, so both see the same conditions
            off.append(drain(redis, entries, off=True))
            on.append(drain(redis, entries, off=False))
        ingest.clean(redis)
    finally:
        redis.close()
        if server is not None:
            server.close()
    a, b = (statistics.median(rate for rate, _ in runs) for runs in (off, on))
    cpu_a, cpu_b = (statistics.median(cpu for _, cpu in runs) for runs in (off, on))
    return [
        Row("ingest, instrumentation off (events/s)", a, None, "", None),
        Row("ingest, metrics + tracing on (events/s)", b, a, f">= {TARGET}", b >= TARGET * a),
        Row("ingest, coordinator CPU per event, off (us)", cpu_a, None, "", None),
        Row(
            "ingest, coordinator CPU per event, on (us)", cpu_b, cpu_a, f"<= {1 / TARGET:.2f}", cpu_b <= cpu_a / TARGET
        ),
    ]


def worker_rows(url: str, jobs: int, repeat: int, otel: dict[str, str]) -> list[Row]:
    this = [sys.executable, "-m", "bench.observability", "--worker-process"]
    carrier = {"traceparent": _trace().traceparent}
    with ExitStack() as stack:
        target = stack.enter_context(start_http_server(TRIVIAL))[1]
        config = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "bench.toml"
        work.write_config(config, target)
        redis = Redis.from_url(url)
        off = on = 0.0
        for _ in range(repeat):
            off = max(
                off, work.compensations_per_second(redis, url, config, jobs, 1, command=[*this, "off"], trace=carrier)
            )
            on = max(
                on,
                work.compensations_per_second(
                    redis, url, config, jobs, 1, command=[*this, "on"], trace=carrier, env=otel
                ),
            )
        redis.flushdb()
        redis.close()
    return [
        Row("worker, instrumentation off (compensations/s)", off, None, "", None),
        Row("worker, metrics + tracing on (compensations/s)", on, off, f">= {TARGET}", on >= TARGET * off),
    ]


@contextmanager
def worker_hooks_off() -> Iterator[None]:
    from mcp_saga.runtime import sessions
    from mcp_saga.workers import job

    saved = job.metrics, job.tracing, sessions.tracing
    job.metrics, job.tracing, sessions.tracing = OFF_METRICS, OFF_TRACING, OFF_TRACING  # type: ignore[assignment]
    try:
        yield
    finally:
        job.metrics, job.tracing, sessions.tracing = saved


def attempt_cpu_rows(url: str, jobs: int, repeat: int) -> list[Row]:
    """CPU time of this process per compensation attempt, run in-process without RQ.

    Wall-clock rates on a shared 2-core box move by 20% between two runs of the same code; the CPU
    the attempt costs this process (its threads included: the session loop, the span exporter)
    moves less, but still by 10-15% when other work crowds the cores. So the modes run in many
    short rounds, in an order that rotates from round to round, and each figure is the median over
    rounds; "off again" is an A/A row that shows the noise left. RQ's own CPU (about 3 ms a job) is
    left out, so the ratios overstate the cost.

    The last row measures the hooks alone, free of the MCP call's noise: what one attempt's
    instrumentation (its span, exported and flushed; its `_meta` context; its metrics) costs in a
    loop that does nothing else, as a share of an attempt with the hooks off.
    """
    import msgspec
    from mcp_saga.runtime.sessions import SessionPool
    from mcp_saga.schemas.events import CompensationSucceeded
    from mcp_saga.workers import job

    carrier = {"traceparent": _trace().traceparent}
    rounds, per = max(1, repeat) * 8, max(20, jobs // 8)
    modes = ("off", "on", "tenth", "again")
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

        def measure(mode: str) -> float:
            batch = planted(per, 0.1 if mode == "tenth" else 1.0)
            with worker_hooks_off() if mode in ("off", "again") else nullcontext():
                started = time.process_time()
                for each in batch:
                    job._Attempt(context, each, None).run()
                return (time.process_time() - started) / per * 1e6

        def hooks(off: bool) -> float:
            batch = planted(jobs)
            report = CompensationSucceeded(
                step="s", dispatch=1, attempt=1, final=True, server="trivial", operation_id="noop_undo",
                idempotency_key="k", arguments_digest="d", duration_ms=1.0, worker="bench", result={},
            )  # fmt: skip
            from opentelemetry import trace

            provider = trace.get_tracer_provider()
            with worker_hooks_off() if off else nullcontext():
                started = time.process_time()
                for each in batch:
                    with job.tracing.attempt(each) as traced:
                        meta = traced.carrier if traced is not None else {}
                        with job.tracing.continued(meta):
                            job.metrics.reported(report)
                        if traced is not None:
                            traced.outcome(report)
                provider.force_flush()  # the exporter's encoding and sending, in its own thread
                return (time.process_time() - started) / jobs * 1e6

        try:
            measure("on")  # warm: the session, the tools/list cache
            runs: dict[str, list[float]] = {mode: [] for mode in modes}
            for i in range(rounds):
                for mode in modes[i % 4 :] + modes[: i % 4]:
                    runs[mode].append(measure(mode))
            own = statistics.median(hooks(off=False) - hooks(off=True) for _ in range(max(1, repeat)))
        finally:
            pool.close()
            redis.flushdb()
            redis.close()
    a, b, c, d = (statistics.median(runs[mode]) for mode in modes)
    return [
        Row("worker attempt CPU, instrumentation off (us)", a, None, "", None),
        Row("worker attempt CPU, off again: the noise (us)", d, a, "~1", None),
        Row("worker attempt CPU, metrics + tracing on (us)", b, a, f"<= {1 / TARGET:.2f}", b <= a / TARGET),
        Row("worker attempt CPU, on, 1 workflow in 10 traced (us)", c, a, f"<= {1 / TARGET:.2f}", c <= a / TARGET),
        Row("worker attempt, the hooks' own CPU (us; share of one)", own, a, f"<= {1 - TARGET:.2f}", own <= a * 0.05),
    ]


def rows(url: str, *, workflows: int = 500, steps: int = 10, jobs: int = 600, repeat: int = 3) -> list[Row]:
    with collector() as otel:
        found = ingest_rows(url, workflows, steps, repeat, otel)
        found += attempt_cpu_rows(url, jobs, repeat)
        return found + worker_rows(url, jobs, repeat, otel)


def worker_process(mode: str, argv: list[str]) -> int:
    """`python -m mcp_saga.workers` with the hooks off, or with tracing and a metrics endpoint on."""
    from mcp_saga.runtime import metrics, sessions
    from mcp_saga.workers import __main__ as entry
    from mcp_saga.workers import job, process

    if mode == "off":
        job.metrics, job.tracing, sessions.tracing = OFF_METRICS, OFF_TRACING, OFF_TRACING  # type: ignore[assignment]
        process.CountingRetry = lambda _component, backoff, retries: Retry(backoff, retries)  # type: ignore[assignment]
    else:
        from mcp_saga.runtime import tracing

        tracing.setup("worker")
        metrics.serve(parse_config({}).metrics, "worker", port=free_port())
    return entry.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker-process"]:
        return worker_process(argv[1], argv[2:])
    if argv[:1] == ["--collector"]:
        return serve_collector(int(argv[1]))
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=500)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    with resolve_redis(None) as url:
        found = rows(url, workflows=args.workflows, steps=args.steps, jobs=args.jobs, repeat=args.repeat)
    print_table(found, "metrics and tracing: on vs off, same run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
