"""Failure-to-compensation latency and LIFO unwind throughput, against raw warm-session calls.

    python -m bench.latency [--redis URL] [--workflows 1000] [--unwinds 20] [--json PATH]

Real processes: `examples.trivial` over streamable HTTP, one `saga coordinator`, one `saga worker`
(warm). The server appends the time each `noop_undo` arrives to a file, so the latency measured is
exactly "XADD of workflow-failed -> compensating call arrives at the MCP server" (same machine,
same clock). The baseline is the same call made directly over a warm session from this process.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import os
import select
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from mcp import Client
from mcp_saga.cli.procs import saga_process, start_http_server, start_http_servers, stop
from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.examples import TRIVIAL
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import Config, ServerConfig, WorkerSettings, write_config
from mcp_saga.schemas.events import StepCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import Keys
from redis import Redis

from bench.gateway import cpu_ns
from bench.table import Row, print_table

RECOVERY = compensation("noop_undo", n="$response.body#/n")
KEYS = Keys()
RAW = 90_000_000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Arrivals:
    """Tails the server's arrivals file: n -> arrival time.

    It waits for the file to grow with inotify, asleep, where the platform has it: the times are the
    server's own, so how soon this process notices changes no figure, but a poll every 0.2 ms (the
    fallback) spent a few percent of a core of the two, and only while a saga's compensations were
    on their way (a direct call returns after its arrival is written, so nothing is polled for then):
    a cost the sagas paid and the baseline did not.
    """

    def __init__(self, path: Path) -> None:
        path.touch()
        self.file = path.open()
        self.seen: dict[int, float] = {}
        self.partial = ""
        self.watch = _watch(path)

    def close(self) -> None:
        self.file.close()
        if self.watch is not None:
            os.close(self.watch)
            self.watch = None

    def _idle(self, deadline: float) -> None:
        """Until the file was written to (or a moment passed, without inotify)."""
        if self.watch is None:
            time.sleep(0.0002)
            return
        ready, _, _ = select.select([self.watch], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
        if ready:
            os.read(self.watch, 4096)  # the queued events: each says only "written"

    def wait(self, n: int, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while n not in self.seen:
            # A line that straddles a page boundary is written in two copies, and a reader between
            # them sees its first part: kept, not dropped (its tail alone read as "<time> <n>" put a
            # compensation first with a made-up time, and the order check failed on nothing).
            line = self.partial + self.file.readline()
            self.partial = ""
            if line.endswith("\n"):
                at, number = line.split()
                self.seen[int(number)] = float(at)
            elif line:
                self.partial = line
            elif time.monotonic() > deadline:
                raise TimeoutError(f"compensation {n} never reached the server")
            else:
                self._idle(deadline)
        return self.seen[n]


def _watch(path: Path) -> int | None:
    """An inotify descriptor that becomes readable when `path` is written to; None off Linux."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(path), 0x00000002) < 0:  # IN_MODIFY
            os.close(fd)
            return None
    except (OSError, AttributeError):
        return None
    return fd


def step(n: int, name: str = "s", server: str = "trivial") -> StepCompleted:
    return StepCompleted(
        step=name, server=server, tool="noop", arguments={"n": n}, result={"structuredContent": {"n": n}},
        recovery=RECOVERY,
    )  # fmt: skip


async def raw_calls(url: str, count: int) -> tuple[list[float], float]:
    """Per-call latency (s) of `noop_undo` over one warm session, and 10 sequential calls' duration."""
    async with Client(url) as client:
        for n in range(RAW, RAW + 50):
            await client.call_tool("noop_undo", {"n": n})
        latencies = []
        for n in range(RAW, RAW + count):  # numbers no workflow uses: the arrivals file sees these too
            start = time.perf_counter()
            await client.call_tool("noop_undo", {"n": n})
            latencies.append(time.perf_counter() - start)
        sequences = []
        for _ in range(20):
            start = time.perf_counter()
            for n in range(RAW, RAW + 10):
                await client.call_tool("noop_undo", {"n": n})
            sequences.append(time.perf_counter() - start)
    return latencies, statistics.median(sequences)


def measure(redis_url: str, workflows: int, unwinds: int) -> list[Row]:
    r = Redis.from_url(redis_url)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="saga-bench-latency-") as tmp:
        workdir = Path(tmp)
        arrivals_path = workdir / "arrivals"
        _, url = stack.enter_context(start_http_server(TRIVIAL, env={"SAGA_TRIVIAL_ARRIVALS": str(arrivals_path)}))
        config = workdir / "saga.toml"
        write_config(Config(servers={"trivial": ServerConfig(url=url)}, worker=WorkerSettings(attempts=1)), config)
        procs = [
            saga_process(role, redis_url=redis_url, config=config, log=workdir / f"{role}.log")
            for role in ("coordinator", "worker")
        ]
        stack.callback(lambda: [stop(p) for p in procs])
        arrivals = Arrivals(arrivals_path)
        stack.callback(arrivals.close)

        raw, raw_sequence = asyncio.run(raw_calls(url, workflows))
        base = 10_000_000
        for n in range(base, base + 30):  # warm the coordinator's and the worker's paths
            r.xadd(KEYS.events, entry_fields(f"warm-{n}", step(n)))
            r.xadd(KEYS.events, entry_fields(f"warm-{n}", WorkflowFailed()))
            arrivals.wait(n, timeout=60)

        latencies = []
        for n in range(workflows):
            r.xadd(KEYS.events, entry_fields(f"lat-{n}", step(n)))
            time.sleep(0.001)  # let the step land first, as it would in a real workflow
            sent = time.time()
            r.xadd(KEYS.events, entry_fields(f"lat-{n}", WorkflowFailed()))
            latencies.append(arrivals.wait(n) - sent)

        durations = []
        for u in range(unwinds):
            first = 20_000_000 + u * 100
            pipe = r.pipeline()
            for i in range(10):
                pipe.xadd(KEYS.events, entry_fields(f"unwind-{u}", step(first + i, f"s{i}")))
            pipe.execute()
            time.sleep(0.01)
            sent = time.time()
            r.xadd(KEYS.events, entry_fields(f"unwind-{u}", WorkflowFailed()))
            times = [arrivals.wait(first + i) for i in range(10)]
            order = sorted(range(10), key=lambda i: times[i])
            assert order == list(range(9, -1, -1)), f"unwind {u} was not LIFO: {order}"
            durations.append(max(times) - sent)

    ms = 1000
    raw_p50, raw_p99 = percentile(raw, 0.5) * ms, percentile(raw, 0.99) * ms
    p50, p99 = percentile(latencies, 0.5) * ms, percentile(latencies, 0.99) * ms
    unwind_rate = 10 / statistics.median(durations)
    direct_rate = 10 / raw_sequence
    return [
        Row("failure->compensation p50 (ms)", p50, raw_p50, f"<= raw + 5 ({raw_p50 + 5:.1f})", p50 <= raw_p50 + 5),
        Row("failure->compensation p99 (ms)", p99, raw_p99, f"<= raw + 25 ({raw_p99 + 25:.1f})", p99 <= raw_p99 + 25),
        Row(
            "LIFO unwind, 10 steps (comp/s)", unwind_rate, direct_rate, "ratio >= 0.7", unwind_rate / direct_rate >= 0.7
        ),
    ]


def reference(redis_url: str, workflows: int, rounds: int = 10) -> list[Row]:
    """The SEP's reference scenario: reserve, charge, the shipment fails; refund, then release.

    Two servers (payments and inventory: the trivial example over streamable HTTP, one process
    each), one coordinator, one worker. Measured: XADD of workflow-failed -> the release call
    arrives at its server. The baseline: the same two calls made directly over warm sessions,
    from the start of the refund to the arrival of the release (the same clock, the same files).

    The two sides run in paired rounds, `workflows / rounds` of each per round, the order
    alternating (AB, BA, ...) as bench/gateway.py does: a baseline slowed by a neighbour in one
    phase then slows only its round's ratio. The p50 row's ratio is the median of the rounds' own
    p50 ratios, with their quartiles; the p99 row's figures are the p99s of all the rounds' samples.
    Beside them, what load stretches much less: the coordinator's and the worker's CPU per saga, over
    the saga rounds.
    """
    r = Redis.from_url(redis_url)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="saga-bench-reference-") as tmp:
        workdir = Path(tmp)
        arrivals_path = workdir / "arrivals"
        env = {"SAGA_TRIVIAL_ARRIVALS": str(arrivals_path)}
        [(_, payments), (_, inventory)] = stack.enter_context(start_http_servers((TRIVIAL,), (TRIVIAL,), env=env))
        config = workdir / "saga.toml"
        servers = {"payments": ServerConfig(url=payments), "inventory": ServerConfig(url=inventory)}
        write_config(Config(servers=servers, worker=WorkerSettings(attempts=1)), config)
        procs = [
            saga_process(role, redis_url=redis_url, config=config, log=workdir / f"{role}.log")
            for role in ("coordinator", "worker")
        ]
        stack.callback(lambda: [stop(p) for p in procs])
        arrivals = Arrivals(arrivals_path)
        stack.callback(arrivals.close)
        pids = {role: p.pid for role, p in zip(("coordinator", "worker"), procs, strict=True)}
        direct, system, cpu = asyncio.run(_paired_rounds(r, payments, inventory, arrivals, workflows, rounds, pids))
    ms = 1000
    everything = [t for one in direct for t in one], [t for one in system for t in one]
    d50, d99 = (percentile(everything[0], q) * ms for q in (0.5, 0.99))
    p50, p99 = (percentile(everything[1], q) * ms for q in (0.5, 0.99))
    ratios = [statistics.median(s) / statistics.median(d) for d, s in zip(direct, system, strict=True)]
    low, ratio, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return [
        Row(
            "reference: failure -> last compensation, p50 (ms)",
            p50,
            d50,
            "<= 1.6x direct",
            ratio <= 1.6,
            paired=ratio,
            spread=(low, high),
        ),
        Row("reference: failure -> last compensation, p99 (ms)", p99, d99, "<= 2x direct", p99 <= 2 * d99),
        *(Row(f"reference: {role} CPU per failing saga (ms)", used * ms, None, "", None) for role, used in cpu.items()),
    ]


async def _paired_rounds(
    r: Redis, payments: str, inventory: str, arrivals: Arrivals, workflows: int, rounds: int, pids: dict[str, int]
) -> tuple[list[list[float]], list[list[float]], dict[str, float]]:
    """Per round, the direct pairs' and the sagas' latencies (s), the two sides alternating first; and
    the CPU seconds per saga of each of the processes `pids` (the coordinator and the worker) in the saga rounds."""
    per_round = max(1, workflows // rounds)
    async with Client(payments) as pay, Client(inventory) as inv:
        for n in range(RAW, RAW + 20):
            await pay.call_tool("noop_undo", {"n": n})
            await inv.call_tool("noop_undo", {"n": n})

        async def direct_pairs(first: int) -> list[float]:
            """Refund then release, made directly over two warm sessions: start -> release arrives."""
            took = []
            for w in range(per_round):
                refund, release = first + 2 * w + 1, first + 2 * w
                start = time.time()
                await pay.call_tool("noop_undo", {"n": refund})
                await inv.call_tool("noop_undo", {"n": release})
                took.append(arrivals.wait(release) - start)
            return took

        def sagas(prefix: str, first: int, count: int) -> list[float]:
            took = []
            for w in range(count):
                refund, release = first + 2 * w + 1, first + 2 * w
                workflow = f"{prefix}-{w}"
                pipe = r.pipeline()
                pipe.xadd(KEYS.events, entry_fields(workflow, step(release, "reserve", "inventory")))
                pipe.xadd(KEYS.events, entry_fields(workflow, step(refund, "charge", "payments")))
                pipe.execute()
                time.sleep(0.002)  # the steps land first, as they would in a real workflow
                sent = time.time()
                r.xadd(KEYS.events, entry_fields(workflow, WorkflowFailed(reason="shipment failed")))
                landed = arrivals.wait(release)
                assert arrivals.wait(refund) < landed, f"{workflow}: release arrived before the refund"
                took.append(landed - sent)
            return took

        sagas("ref-warm", 30_000_000, 20)
        direct: list[list[float]] = []
        system: list[list[float]] = []
        used = dict.fromkeys(pids, 0)

        def measured(i: int, first: int) -> list[float]:
            before = {role: cpu_ns(pid) for role, pid in pids.items()}
            took = sagas(f"ref-{i}", first, per_round)
            for role, pid in pids.items():
                used[role] += cpu_ns(pid) - before[role]
            return took

        for i in range(rounds):
            first = 40_000_000 + i * 2 * per_round
            if i % 2:
                system.append(measured(i, first))
                direct.append(await direct_pairs(RAW + 1000 + first))
            else:
                direct.append(await direct_pairs(RAW + 1000 + first))
                system.append(measured(i, first))
    return direct, system, {role: ns / 1e9 / (rounds * per_round) for role, ns in used.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    parser.add_argument("--workflows", type=int, default=1000)
    parser.add_argument("--unwinds", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    with resolve_redis(args.redis) as url:
        rows = measure(url, args.workflows, args.unwinds) + reference(url, args.workflows)
    print_table(rows, "latency and unwind")
    if args.json:
        args.json.write_text(json.dumps([row.as_dict() for row in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
