"""How close a worker gets to its two ceilings: the MCP session and RQ itself.

    python -m bench.worker [--redis URL] [--calls 1200] [--jobs 600] [--workers 1,2,4]
                            [--rounds 2] [--http] [--against CHECKOUT]

(a) raw `call_tool` calls/s over one warm session to `examples.trivial`'s `noop`, awaited
    directly (and, for reference, through `SessionPool` from a sync caller);
(b) no-op jobs/s through one RQ `SimpleWorker`;
(c) compensations/s through `python -m workers` processes (what `saga worker` runs): record,
    lease, trust checks, `noop_undo` with the idempotency key, report.

A compensation costs one call plus one RQ job, so with the SDK's call c could only approach
min(a, b); c / min(a, b) says how much the worker adds. One worker process does the call and the
job one after the other, so with the SDK's call its c would also be bounded by 1/(1/a + 1/b); the
script prints that bound too. Over HTTP the worker's call skips the SDK's client (runtime/lean_call.py:
under a third of its CPU a call), so c may pass that bound; a stays the SDK's call, what a user would make.

Queues are filled before the workers start, and c is measured from the moment every worker has
reported once (sessions warm) to the last report, from the reports' own stream ids. The worker
processes' CPU per compensation (utime + stime from /proc, from the tenth of the reports to the
last) is printed beside it: it moves far less with other load on the machine than the rate.

`--against CHECKOUT` compares this code with another checkout of mcp-saga (its own `.venv`, e.g.
a worktree of main): one worker process of each in alternating rounds (ABAB...), the same queue,
server and Redis, and prints the median of the rounds' ratios. Without --redis a private
redis-server is started and thrown away.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from mcp import Client
from mcp_saga.cli.procs import REPO, start_http_server, stdio_params, stop_all
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from mcp_saga.coordinator.queue import enqueue
from mcp_saga.examples import TRIVIAL
from mcp_saga.runtime.sessions import SessionPool
from mcp_saga.schemas import config as model
from mcp_saga.schemas.config import Config, ServerConfig, WorkerSettings
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import Compensation, CompensationJob, comp_encoder, idempotency_key
from redis import Redis
from rq import Queue, SimpleWorker

from bench.table import Row

PREFIX = "saga-bench"
TARGET = 0.7


def noop() -> None:
    """The job of (b)."""


def calls_per_second(target: str | None, calls: int) -> tuple[float, float]:
    """(direct awaits, through SessionPool) over one warm session each."""

    async def direct() -> float:
        async with Client(target or stdio_params(TRIVIAL)) as client:
            for n in range(50):
                await client.call_tool("noop", {"n": n})
            started = time.perf_counter()
            for n in range(calls):
                await client.call_tool("noop", {"n": n})
            return calls / (time.perf_counter() - started)

    raw = asyncio.run(direct())
    with SessionPool({"trivial": _server(target)}) as pool:
        for n in range(50):
            pool.call_tool("trivial", "noop", {"n": n})
        started = time.perf_counter()
        for n in range(calls):
            pool.call_tool("trivial", "noop", {"n": n})
        pooled = calls / (time.perf_counter() - started)
    return raw, pooled


def rq_jobs_per_second(redis: Redis, jobs: int) -> float:
    queue = Queue(f"{PREFIX}-noop", connection=redis)
    queue.enqueue_many([Queue.prepare_data(noop, result_ttl=60) for _ in range(jobs)])
    worker = SimpleWorker([queue], connection=redis)
    started = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    return jobs / (time.perf_counter() - started)


@dataclass
class Run:
    """One run of worker processes over a full queue."""

    rate: float  # compensations/s, once every worker is warm
    cpu_us: float  # the worker processes' CPU per compensation, from a tenth of the reports on


def run_workers(
    redis: Redis,
    url: str,
    config: Path,
    jobs: int,
    workers: int,
    *,
    command: list[str] | None = None,
    env: dict[str, str] | None = None,
    trace: dict[str, str] | None = None,
    cwd: Path = REPO,
    sample: bool = True,
) -> Run:
    """Fill the queue, run `workers` processes in burst mode over it; `cwd`: the checkout they run from.

    `sample=False`: the processes are only waited for, their CPU not sampled (nan), for a caller
    that measures inside them: the sampling reads /proc and asks Redis every 3 ms, work that
    shares the cores with the processes measured."""
    redis.flushdb()
    keys, settings = Keys(PREFIX), WorkerSettings()
    queue = Queue(keys.queue, connection=redis)
    for job in plant(redis, jobs, trace):
        enqueue(queue, job, settings)
    command = [*(command or [sys.executable, "-m", "mcp_saga.workers"]), "--redis", url, "--config", str(config)]
    procs = [
        subprocess.Popen(
            [*command, "--burst", "--log-level", "WARNING", "--name", f"bench-{workers}-{i}"],
            cwd=cwd,
            env={**os.environ, **(env or {})},
        )
        for i in range(workers)
    ]
    try:
        cpu_us = _cpu_per_report(redis, keys.events, jobs, procs) if sample else _waited(procs)
    finally:
        stop_all(*procs)
    entries = redis.xrange(keys.events)
    kinds = {fields[b"type"].decode() for _, fields in entries}
    assert kinds == {"compensation-succeeded"} and len(entries) == jobs, (kinds, len(entries))
    reports = [(int(entry_id.split(b"-")[0]), json.loads(fields[b"data"])) for entry_id, fields in entries]
    first_by_worker: dict[str, int] = {}
    for at, data in reports:
        first_by_worker.setdefault(data["worker"], at)
    warm = max(first_by_worker.values())
    counted = [at for at, _ in reports if at > warm]
    return Run(len(counted) / ((counted[-1] - warm) / 1000), cpu_us)


def _cpu_per_report(redis: Redis, events: str, jobs: int, procs: list[subprocess.Popen[bytes]]) -> float:
    """Wait for the processes; their CPU (µs) per report between the tenth of the reports and the last.

    Sampled from /proc every few milliseconds, so start-up (imports, connecting) and exit are left
    out; nan where /proc is missing.
    """
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float | None:
        total = 0
        for proc in procs:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                return None
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    start: tuple[int, float] | None = None
    last: tuple[int, float] | None = None
    deadline = time.monotonic() + 300
    while any(proc.poll() is None for proc in procs):
        if time.monotonic() > deadline:
            raise TimeoutError("the worker processes did not drain the queue within 300 s")
        done, spent = redis.xlen(events), cpu()
        if spent is not None:
            if start is None and done >= jobs // 10:
                start = (done, spent)
            if last is None or last[0] < jobs:  # up to the first sample with every report in
                last = (done, spent)
        time.sleep(0.003)
    if start is None or last is None or last[0] <= start[0]:
        return float("nan")
    return (last[1] - start[1]) / (last[0] - start[0]) * 1e6


def _waited(procs: list[subprocess.Popen[bytes]]) -> float:
    deadline = time.monotonic() + 300
    for proc in procs:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return float("nan")


def plant(redis: Redis, jobs: int, trace: dict[str, str] | None = None, first: int = 0) -> list[CompensationJob]:
    """`jobs` queued compensation records of `noop_undo`, as a coordinator leaves them, and their jobs."""
    keys, planted = Keys(PREFIX), []
    for n in range(first, first + jobs):
        workflow, key = f"bench-{n}", idempotency_key(f"bench-{n}", "s", "noop_undo")
        record = Compensation(
            step="s", seq=1, server="trivial", tool="noop", status="queued", operation_id="noop_undo",
            arguments={"n": n}, idempotency_key=key, source="server", dispatch=1,
        )  # fmt: skip
        redis.hset(keys.comp(workflow), "s", comp_encoder.encode(record))
        job = CompensationJob(  # with the step's seq, as the coordinator dispatches it
            workflow=workflow, step="s", seq=1, server="trivial", tool="noop", operation_id="noop_undo",
            arguments={"n": n}, idempotency_key=key, dispatch=1, prefix=PREFIX, trace=trace,
        )  # fmt: skip
        planted.append(job)
    return planted


def rows(
    redis_url: str, *, http: bool = True, calls: int = 1200, jobs: int = 600, workers: tuple[int, ...] = (1, 2, 4)
) -> list[Row]:
    """The suite's rows: one worker process against min(raw calls/s, RQ no-op jobs/s), then 1, 2, 4."""
    with ExitStack() as stack:
        target = stack.enter_context(start_http_server(TRIVIAL))[1] if http else None
        config = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "bench.toml"
        write_config(config, target)
        redis = Redis.from_url(redis_url)
        a, _ = calls_per_second(target, calls)
        b = rq_jobs_per_second(redis, jobs)
        c = {n: run_workers(redis, redis_url, config, jobs, n).rate for n in workers}
        redis.flushdb()
    floor = min(a, b)
    found = [
        Row("worker: raw warm call_tool (calls/s)", a, None, "", None),
        Row("worker: RQ SimpleWorker no-op (jobs/s)", b, None, "", None),
        Row(
            "worker: compensations/s, 1 process", c[workers[0]], floor, ">= 0.7 of min", c[workers[0]] >= TARGET * floor
        ),
    ]
    found += [Row(f"worker: compensations/s, {n} processes", c[n], c[workers[0]], "scales", None) for n in workers[1:]]
    return found


def write_config(path: Path, target: str | None) -> None:
    stdio = ServerConfig(command=[sys.executable, "-m", TRIVIAL], cwd=str(REPO))
    model.write_config(Config(prefix=PREFIX, servers={"trivial": ServerConfig(url=target) if target else stdio}), path)


def _server(url: str | None) -> ServerConfig:
    if url:
        return ServerConfig(url=url)
    return ServerConfig(command=[sys.executable, "-m", TRIVIAL], cwd=str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server; the DB is flushed)")
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=2, help="a, b and c with one worker: best of this many")
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument("--against", type=Path, help="another checkout (with .venv): one worker of each, ABAB")
    args = parser.parse_args(argv)
    if args.against:
        return against(args.against, args.redis, args.jobs, args.rounds, args.http)
    counts = [int(n) for n in args.workers.split(",")]
    started = time.perf_counter()
    with ExitStack() as stack:
        if args.redis:
            url = args.redis
        else:
            server = RedisServer(find_redis_server() or "redis-server").start()
            stack.callback(server.cleanup)
            url = server.url
        target = stack.enter_context(start_http_server(TRIVIAL))[1] if args.http else None
        config = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "bench.toml"
        write_config(config, target)
        redis = Redis.from_url(url)
        redis.flushdb()
        # Other load on the machine only ever slows a run down, so the best of a few rounds is the
        # closest to what the code can do; a, b and c take turns so that they share the conditions.
        a = pooled = b = 0.0
        c: dict[int, float] = {}
        for _ in range(args.rounds):
            direct, via_pool = calls_per_second(target, args.calls)
            a, pooled = max(a, direct), max(pooled, via_pool)
            b = max(b, rq_jobs_per_second(redis, args.jobs))
            one = run_workers(redis, url, config, args.jobs, counts[0]).rate
            c[counts[0]] = max(c.get(counts[0], 0.0), one)
        for n in counts[1:]:
            c[n] = run_workers(redis, url, config, args.jobs, n).rate

    transport = "streamable HTTP" if target else "stdio"
    first, serial = c[counts[0]], 1 / (1 / a + 1 / b)
    ratio = first / min(a, b)
    print(f"(a) call_tool over one warm {transport} session: {a:6.0f} calls/s   (through SessionPool: {pooled:.0f})")
    print(f"(b) RQ SimpleWorker, no-op jobs:               {b:6.0f} jobs/s")
    print(f"(c) compensations, {counts[0]} worker process:          {first:6.0f} /s")
    print(f"    c / min(a, b) = {ratio:.2f}   (target >= {TARGET}: {'met' if ratio >= TARGET else 'not met'})")
    print(f"    an SDK call and a job in series would bound one worker at 1/(1/a + 1/b) = {serial:.0f}/s")
    print(f"    (c / min(a, b) <= {serial / min(a, b):.2f} here); c reaches {first / serial:.2f} of that bound")
    for n in counts:
        print(f"    {n} worker process{'es' if n > 1 else '  '}: {c[n]:6.0f} compensations/s")
    print(f"best of {args.rounds} rounds for a, b and c({counts[0]}); total {time.perf_counter() - started:.0f} s")
    return 0


def against(other: Path, redis_url: str | None, jobs: int, rounds: int, http: bool) -> int:
    """This checkout's worker (B) against another's (A), one process each, in alternating rounds."""
    other = other.resolve()
    python = other / ".venv" / "bin" / "python"
    if not python.exists():
        print(f"{python}: no such interpreter (make the checkout's venv first)", file=sys.stderr)
        return 2
    runs: dict[str, list[Run]] = {"A": [], "B": []}
    with ExitStack() as stack:
        if redis_url is None:
            server = RedisServer(find_redis_server() or "redis-server").start()
            stack.callback(server.cleanup)
            redis_url = server.url
        target = stack.enter_context(start_http_server(TRIVIAL))[1] if http else None
        config = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "bench.toml"
        write_config(config, target)
        redis = Redis.from_url(redis_url)
        sides = {
            "A": ([str(python), "-m", "mcp_saga.workers"], other),
            "B": ([sys.executable, "-m", "mcp_saga.workers"], REPO),
        }
        for n in range(rounds):
            for side in "AB" if n % 2 == 0 else "BA":
                command, cwd = sides[side]
                runs[side].append(run_workers(redis, redis_url, config, jobs, 1, command=command, cwd=cwd))
        redis.flushdb()
    print(f"A = {other}, B = {REPO}; {rounds} rounds of {jobs} jobs, load average {os.getloadavg()[0]:.2f}")
    for label, pick in (("compensations/s", lambda r: r.rate), ("CPU per compensation (us)", lambda r: r.cpu_us)):
        a, b = [pick(r) for r in runs["A"]], [pick(r) for r in runs["B"]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(
            f"{label:28s} A {statistics.median(a):8.1f}  B {statistics.median(b):8.1f}"
            f"  B/A median {statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
