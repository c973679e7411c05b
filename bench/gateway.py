"""What a tool call costs through `saga gateway` against the same call made directly, at a 2 ms tool.

    python -m bench.gateway [--calls 100] [--rounds 20] [--redis URL]

The upstream is bench.publisher's server over streamable HTTP (one tool sleeping 2 ms that
declares its compensation); the gateway is a real `saga gateway` process in front of it, which
forwards each call and records it: the intent awaited before forwarding (one XADD round trip on the
call's path; `--no-intents` turns it off to measure its share), the step-completed off the path.
Direct and gateway rounds alternate in shuffled order over warm sessions, so load from other
processes hits both alike; the figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from bench.publisher import DELAY
from bench.table import Row

PREFIX = "benchgw"  # its own stream, deleted afterwards


async def measure(direct_url: str, gateway_url: str, calls: int, rounds: int) -> dict[str, list[float]]:
    import time

    from mcp import Client
    from mcp_saga.schemas.events import WORKFLOW_META_KEY

    async with Client(direct_url) as direct, Client(gateway_url) as gateway:

        async def run(client: Client, round_no: int) -> float:
            meta = {WORKFLOW_META_KEY: f"bench-{round_no}"} if client is gateway else None
            start = time.perf_counter()
            for n in range(calls):
                await client.call_tool("work", {"n": n}, meta=meta)
            return (time.perf_counter() - start) / calls

        modes = {"direct": direct, "gateway": gateway}
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for client in modes.values():
            await run(client, -1)  # warm-up: sessions, the gateway's tools/list cache
        for i in range(rounds):
            for mode in random.sample(list(modes), len(modes)):
                times[mode].append(await run(modes[mode], i))
    return times


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc), to say what the gateway itself costs per call."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timings(redis_url: str, *, calls: int, rounds: int, intents: bool = True) -> dict[str, list[float]]:
    import redis
    from mcp_saga.cli.procs import free_port, saga_process, start_http_server, stop, wait_until_accepting
    from mcp_saga.schemas.config import parse_config, write_config

    with start_http_server("bench.publisher", "--serve") as (_, upstream), tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        gateway_settings = {"port": port, "allow_anonymous": True, "intents": intents}
        settings = {"servers": {"bench": {"url": upstream}}, "gateway": gateway_settings}
        config = write_config(parse_config({"prefix": PREFIX, **settings}), Path(tmp) / "saga.toml")
        gateway = saga_process("gateway", redis_url=redis_url, config=config, env={"SAGA_LOG_LEVEL": "WARNING"})
        try:
            wait_until_accepting("127.0.0.1", port, gateway)
            before = cpu_seconds(gateway.pid)
            times = asyncio.run(measure(upstream, f"http://127.0.0.1:{port}/mcp/bench", calls, rounds))
            # Calls through the gateway: the warm-up round and `rounds` measured ones.
            times["gateway_cpu"] = [(cpu_seconds(gateway.pid) - before) / (calls * (rounds + 1))]
            return times
        finally:
            stop(gateway)
            client = redis.Redis.from_url(redis_url)
            client.delete(f"{PREFIX}:events")
            client.close()


def rows(redis_url: str, *, calls: int = 100, rounds: int = 20) -> list[Row]:
    """The suite's row: a call through the gateway against the same call made directly, medians over rounds."""
    times = timings(redis_url, calls=calls, rounds=rounds)
    direct, through = statistics.median(times["direct"]) * 1000, statistics.median(times["gateway"]) * 1000
    name = f"gateway: tools/call at a {DELAY * 1000:g} ms tool, HTTP (ms)"
    return [Row(name, through, direct, "<= 1.10", through <= 1.1 * direct)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    parser.add_argument("--no-intents", action="store_true", help="[gateway] intents = false: no awaited intent")
    args = parser.parse_args(argv)
    from mcp_saga.cli.redis_server import resolve_redis

    with resolve_redis(args.redis) as url:
        times = timings(url, calls=args.calls, rounds=args.rounds, intents=not args.no_intents)
    direct, through = statistics.median(times["direct"]), statistics.median(times["gateway"])
    print(f"tool sleeps {DELAY * 1000:g} ms, streamable HTTP, {args.rounds} rounds of {args.calls} calls each way;")
    print(f"intents {'off' if args.no_intents else 'on'};")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'direct call ms':22}{direct * 1000:10.3f}")
    print(f"{'through gateway ms':22}{through * 1000:10.3f}")
    print(f"{'overhead ms':22}{(through - direct) * 1000:10.3f}")
    print(f"{'ratio':22}{through / direct:10.3f}")
    print(f"{'gateway CPU ms/call':22}{times['gateway_cpu'][0] * 1000:10.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
