"""What `wf.call` costs over a bare `Client.call_tool`, against a tool that takes about 2 ms.

    python -m bench.publisher [--calls 100] [--steps 10] [--rounds 30] [--http] [--redis-py-too] [--redis URL]

The server is this module (`--serve`): one tool that sleeps 2 ms and declares its compensation,
so the wrapper does everything it does in production (listing read once, the call's intent
written and awaited before it, one XADD per call after it, the terminal event once per `--steps`
calls). A third mode runs the wrapper with `intents=False`, so the cost of the awaited intent
(one Redis round trip before each call) is measured against the same bare calls in the same run.
The modes alternate on the same session in short rounds, so that load from other processes on a
shared machine hits them alike; the figures are medians over the rounds. `--redis-py-too` adds
both wrapper modes with the events on redis-py's client instead of the pipelined connection (the
SDK's path before 2026-12-03, for an A/B in one run) and prints each mode's paired ratio to the
bare round beside it and this process's CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mcp_saga
from bench.table import Row

REPO = Path(__file__).resolve().parents[1]
DELAY = 0.002


def serve(http: int | None) -> None:
    from mcp.server.mcpserver import MCPServer
    from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool

    app = MCPServer("bench", log_level="WARNING")

    @recoverable_tool(app, compensation("undo_work", n="$response.body#/n"))
    async def work(n: int) -> dict[str, int]:
        await asyncio.sleep(DELAY)
        return {"n": n}

    @app.tool()
    def undo_work(n: int) -> dict[str, int]:
        return {"n": n}

    app.run("streamable-http", host="127.0.0.1", port=http) if http else app.run()


PREFIX = "bench"  # its own stream, deleted afterwards: never touch a real saga:events


@contextlib.contextmanager
def _on_redis_py() -> Iterator[None]:
    """The SDK's events on redis-py's client, as before the pipelined connection: no pipe is found."""
    from mcp_saga.orchestrator import wrapper

    async def none(*_: object) -> None:
        return None

    shared, wrapper.shared_pipelined = wrapper.shared_pipelined, none  # type: ignore[assignment]
    try:
        yield
    finally:
        wrapper.shared_pipelined = shared


async def measure(
    client: object, redis_url: str, calls: int, steps: int, rounds: int, redis_py_too: bool = False
) -> dict[str, list[float]]:
    """Seconds per call of each mode, one entry per round; with `redis_py_too`, also "cpu:MODE", this
    process's CPU seconds per call in the same rounds."""
    import redis.asyncio as aioredis

    async def bare(_: int) -> None:
        for n in range(calls):
            await client.call_tool("work", {"n": n})  # type: ignore[attr-defined]

    async def wrapped(round_no: int, intents: bool = True, redis_py: bool = False) -> None:
        with _on_redis_py() if redis_py else contextlib.nullcontext():
            for w in range(calls // steps):
                async with mcp_saga.workflow(
                    f"bench-{round_no}-{w}", redis=r, servers={"bench": client}, prefix=PREFIX, intents=intents
                ) as wf:
                    for n in range(steps):
                        await wf.call("bench", "work", {"n": n})

    r = aioredis.Redis.from_url(redis_url)
    modes = {
        "bare": bare,
        "wrapped": wrapped,
        "no-intents": lambda i: wrapped(i, intents=False),
    }
    if redis_py_too:
        modes["wrapped/redis-py"] = lambda i: wrapped(i, redis_py=True)
        modes["no-intents/redis-py"] = lambda i: wrapped(i, intents=False, redis_py=True)
    per_round = {"bare": calls, **{mode: calls // steps * steps for mode in modes if mode != "bare"}}
    times: dict[str, list[float]] = {mode: [] for mode in modes} | {f"cpu:{mode}": [] for mode in modes}
    try:
        for fn in modes.values():
            await fn(-1)  # warm-up: connections, the tools/list cache
        for i in range(rounds):
            for mode in random.sample(list(modes), len(modes)):
                cpu, start = time.process_time(), time.perf_counter()
                await modes[mode](i)
                times[mode].append((time.perf_counter() - start) / per_round[mode])
                times[f"cpu:{mode}"].append((time.process_time() - cpu) / per_round[mode])
    finally:
        await r.delete(f"{PREFIX}:events")
        await r.aclose()
    return times


async def timings(
    redis_url: str, *, http: bool, calls: int, steps: int, rounds: int, redis_py_too: bool = False
) -> dict[str, list[float]]:
    from mcp import Client, StdioServerParameters

    if http:
        from mcp_saga.cli.procs import start_http_server

        with start_http_server("bench.publisher", "--serve") as (_, url):
            async with Client(url) as client:
                return await measure(client, redis_url, calls, steps, rounds, redis_py_too)
    params = StdioServerParameters(command=sys.executable, args=["-m", "bench.publisher", "--serve"], cwd=str(REPO))
    async with Client(params) as client:
        return await measure(client, redis_url, calls, steps, rounds, redis_py_too)


def rows(redis_url: str, *, http: bool = False, calls: int = 100, steps: int = 10, rounds: int = 20) -> list[Row]:
    """The suite's row: the wrapper's per-call time against a bare call, medians over rounds."""
    times = asyncio.run(timings(redis_url, http=http, calls=calls, steps=steps, rounds=rounds))
    bare, wrapped = statistics.median(times["bare"]) * 1000, statistics.median(times["wrapped"]) * 1000
    plain = statistics.median(times["no-intents"]) * 1000
    return [
        Row(f"publisher: wf.call at a {DELAY * 1000:g} ms tool (ms)", wrapped, bare, "<= 1.10", wrapped <= 1.1 * bare),
        Row("publisher: wf.call with intents=False (ms)", plain, bare, "<= 1.10", plain <= 1.1 * bare),
        Row("publisher: the awaited intent, per call (ms)", wrapped - plain, None, "reported", None),
    ]


async def run(args: argparse.Namespace, redis_url: str) -> None:
    sizes = {"calls": args.calls, "steps": args.steps, "rounds": args.rounds}
    times = await timings(redis_url, http=args.http, redis_py_too=args.redis_py_too, **sizes)
    transport = "streamable HTTP" if args.http else "stdio"
    print(f"tool sleeps {DELAY * 1000:g} ms, {transport}, {args.steps} calls per workflow (end event included);")
    print(f"{args.rounds} rounds of {args.calls} calls each way, order shuffled; load average {os.getloadavg()[0]:.2f}")
    print(f"{'':22}{'median':>10}{'best round':>12}")
    bare = (statistics.median(times["bare"]), min(times["bare"]))
    wrapped = (statistics.median(times["wrapped"]), min(times["wrapped"]))
    plain = (statistics.median(times["no-intents"]), min(times["no-intents"]))
    print(f"{'bare call_tool ms':22}{bare[0] * 1000:10.3f}{bare[1] * 1000:12.3f}")
    print(f"{'wf.call, no intents':22}{plain[0] * 1000:10.3f}{plain[1] * 1000:12.3f}")
    print(f"{'wf.call ms':22}{wrapped[0] * 1000:10.3f}{wrapped[1] * 1000:12.3f}")
    print(f"{'intent ms':22}{(wrapped[0] - plain[0]) * 1000:10.3f}{(wrapped[1] - plain[1]) * 1000:12.3f}")
    print(f"{'overhead ms':22}{(wrapped[0] - bare[0]) * 1000:10.3f}{(wrapped[1] - bare[1]) * 1000:12.3f}")
    print(f"{'ratio':22}{wrapped[0] / bare[0]:10.3f}{wrapped[1] / bare[1]:12.3f}")
    if args.redis_py_too:
        print("each mode against the bare round beside it (paired), and this process's CPU per call:")
        print(f"{'':22}{'ratio':>10}{'CPU us':>10}{'CPU over bare':>15}")
        cpu_bare = statistics.median(times["cpu:bare"]) * 1e6
        for mode in ("no-intents", "no-intents/redis-py", "wrapped", "wrapped/redis-py"):
            paired = statistics.median(a / b for a, b in zip(times[mode], times["bare"], strict=True))
            cpu = statistics.median(times[f"cpu:{mode}"]) * 1e6
            print(f"{mode:22}{paired:10.3f}{cpu:10.0f}{cpu - cpu_bare:15.0f}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv:  # the server side, started as `--serve` (stdio) or by start_http_server
        served = argparse.ArgumentParser()
        served.add_argument("--serve", action="store_true")
        served.add_argument("--http", type=int)
        served.add_argument("--host", default="127.0.0.1")
        return serve(served.parse_args(argv).http)
    parser = argparse.ArgumentParser(prog="python -m bench.publisher", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--steps", type=int, default=10, help="calls per workflow")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument(
        "--redis-py-too", action="store_true", help="also the wrapper with its events on redis-py (A/B, same run)"
    )
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    args = parser.parse_args(argv)
    from mcp_saga.cli.redis_server import resolve_redis

    with resolve_redis(args.redis) as url:
        asyncio.run(run(args, url))


if __name__ == "__main__":
    main(sys.argv[1:])
