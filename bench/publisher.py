"""What `wf.call` costs over a bare `Client.call_tool`, against a tool that takes about 2 ms.

    python -m bench.publisher [--calls 100] [--steps 10] [--rounds 30] [--http] [--redis URL]

The server is this module (`--serve`): one tool that sleeps 2 ms and declares its compensation,
so the wrapper does everything it does in production (listing read once, the call's intent
written and awaited before it, one XADD per call after it, the terminal event once per `--steps`
calls). A third mode runs the wrapper with `intents=False`, so the cost of the awaited intent
(one Redis round trip before each call) is measured against the same bare calls in the same run.
The modes alternate on the same session in short rounds, so that load from other processes on a
shared machine hits them alike; the figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
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


async def measure(client: object, redis_url: str, calls: int, steps: int, rounds: int) -> dict[str, list[float]]:
    import redis.asyncio as aioredis

    async def bare(_: int) -> float:
        start = time.perf_counter()
        for n in range(calls):
            await client.call_tool("work", {"n": n})  # type: ignore[attr-defined]
        return (time.perf_counter() - start) / calls

    async def wrapped(round_no: int, intents: bool = True) -> float:
        start = time.perf_counter()
        for w in range(calls // steps):
            async with mcp_saga.workflow(
                f"bench-{round_no}-{w}", redis=r, servers={"bench": client}, prefix=PREFIX, intents=intents
            ) as wf:
                for n in range(steps):
                    await wf.call("bench", "work", {"n": n})
        return (time.perf_counter() - start) / (calls // steps * steps)

    async def no_intents(round_no: int) -> float:
        return await wrapped(round_no, intents=False)

    r = aioredis.Redis.from_url(redis_url)
    modes = {"bare": bare, "wrapped": wrapped, "no-intents": no_intents}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for fn in modes.values():
            await fn(-1)  # warm-up: connections, the tools/list cache
        for i in range(rounds):
            for mode in random.sample(list(modes), len(modes)):
                times[mode].append(await modes[mode](i))
    finally:
        await r.delete(f"{PREFIX}:events")
        await r.aclose()
    return times


async def timings(redis_url: str, *, http: bool, calls: int, steps: int, rounds: int) -> dict[str, list[float]]:
    from mcp import Client, StdioServerParameters

    if http:
        from mcp_saga.cli.procs import start_http_server

        with start_http_server("bench.publisher", "--serve") as (_, url):
            async with Client(url) as client:
                return await measure(client, redis_url, calls, steps, rounds)
    params = StdioServerParameters(command=sys.executable, args=["-m", "bench.publisher", "--serve"], cwd=str(REPO))
    async with Client(params) as client:
        return await measure(client, redis_url, calls, steps, rounds)


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
    times = await timings(redis_url, http=args.http, calls=args.calls, steps=args.steps, rounds=args.rounds)
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
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    args = parser.parse_args(argv)
    from mcp_saga.cli.redis_server import resolve_redis

    with resolve_redis(args.redis) as url:
        asyncio.run(run(args, url))


if __name__ == "__main__":
    main(sys.argv[1:])
