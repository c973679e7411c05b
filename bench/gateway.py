"""What a tool call costs through `saga gateway` against the same call made directly, at a 2 ms tool.

    python -m bench.gateway [--calls 100] [--rounds 15] [--no-intents] [--profile OUT.svg] [--redis URL]

The upstream is bench.publisher's server over streamable HTTP (one tool sleeping 2 ms that
declares its compensation); the gateway is a real `saga gateway` process in front of it, which
forwards each call and records it: the intent awaited before forwarding (one XADD round trip on the
call's path; `--no-intents` turns it off to measure its share), the step-completed after the answer.

On a shared machine the wall-clock of one run says more about the neighbours than about the code,
so the figures are built to resist load. Rounds are paired: each round is one batch of direct
calls and one through the gateway, back to back, the order alternating (AB, BA, AB, ...) so that
neither side always gets the warmer core; the figure is the median of the rounds' own ratios, with
their spread. Beside it, the gateway process's CPU per call (its threads' time on a CPU, from
`/proc/PID/task/*/schedstat`, in nanoseconds), which load stretches much less than wall-clock:
what the gateway adds to a call on a free core is about that CPU plus the intent's round trip.
`--profile` records the gateway with py-spy during the measured rounds (py-spy must be installed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.publisher import DELAY
from bench.table import Row

PREFIX = "benchgw"  # its own stream, deleted afterwards


def cpu_ns(pid: int) -> int:
    """Time a process's threads have spent on a CPU so far (Linux schedstat, nanoseconds, not clock ticks:
    a round of 100 calls uses about 100 ms of the gateway's CPU, which ticks of 10 ms would blur)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total


def user_system(pid: int) -> tuple[int, int]:
    """A process's user and system CPU so far, in clock ticks: over a whole run, how much is the kernel's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


@dataclass
class Rounds:
    """Per-round figures: seconds per call each way, and the gateway's CPU seconds per call in its rounds."""

    direct: list[float]
    gateway: list[float]
    gateway_cpu: list[float]
    kernel_share: float = 0.0  # of the gateway's CPU over the whole run (warm-up included)

    @property
    def ratios(self) -> list[float]:
        return [through / direct for direct, through in zip(self.direct, self.gateway, strict=True)]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


async def measure(direct_url: str, gateway_url: str, calls: int, rounds: int, cpu: Callable[[], int]) -> Rounds:
    from mcp import Client
    from mcp_saga.schemas.events import WORKFLOW_META_KEY

    async with Client(direct_url) as direct, Client(gateway_url) as gateway:

        async def run(client: Client, round_no: int) -> float:
            meta = {WORKFLOW_META_KEY: f"bench-{round_no}"} if client is gateway else None
            start = time.perf_counter()
            for n in range(calls):
                await client.call_tool("work", {"n": n}, meta=meta)
            return (time.perf_counter() - start) / calls

        async def through(round_no: int) -> tuple[float, float]:
            before = cpu()
            seconds = await run(gateway, round_no)
            return seconds, (cpu() - before) / 1e9 / calls

        await run(direct, -1)  # warm-up: sessions, connections, the gateway's tools/list cache
        await through(-1)
        result = Rounds([], [], [])
        for i in range(rounds):
            if i % 2:
                seconds, spent = await through(i)
                result.direct.append(await run(direct, i))
            else:
                result.direct.append(await run(direct, i))
                seconds, spent = await through(i)
            result.gateway.append(seconds)
            result.gateway_cpu.append(spent)
    return result


def _profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    command = [spy, "record", "--pid", str(pid), "--output", str(out), "--rate", "250", "--nonblocking"]
    if out.suffix == ".txt":
        command += ["--format", "raw"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def timings(redis_url: str, *, calls: int, rounds: int, intents: bool = True, profile: Path | None = None) -> Rounds:
    import redis
    from mcp_saga.cli.procs import free_port, saga_process, start_http_server, stop, wait_until_accepting
    from mcp_saga.schemas.config import parse_config, write_config

    with start_http_server("bench.publisher", "--serve") as (_, upstream), tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        gateway_settings = {"port": port, "allow_anonymous": True, "intents": intents}
        settings = {"servers": {"bench": {"url": upstream}}, "gateway": gateway_settings}
        config = write_config(parse_config({"prefix": PREFIX, **settings}), Path(tmp) / "saga.toml")
        gateway = saga_process("gateway", redis_url=redis_url, config=config, env={"SAGA_LOG_LEVEL": "WARNING"})
        spy = None
        try:
            wait_until_accepting("127.0.0.1", port, gateway)
            if profile is not None:
                spy = _profiler(gateway.pid, profile)
                time.sleep(1.0)  # attached before the rounds start
            url = f"http://127.0.0.1:{port}/mcp/bench"
            user, system = user_system(gateway.pid)
            measured = asyncio.run(measure(upstream, url, calls, rounds, lambda: cpu_ns(gateway.pid)))
            user, system = (now - then for now, then in zip(user_system(gateway.pid), (user, system), strict=True))
            measured.kernel_share = system / ((user + system) or 1)
            return measured
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
                spy.wait(30)
            stop(gateway)
            client = redis.Redis.from_url(redis_url)
            client.delete(f"{PREFIX}:events")
            client.close()


def rows(redis_url: str, *, calls: int = 100, rounds: int = 15) -> list[Row]:
    """The suite's rows: the median of paired rounds' ratios (through / direct), and the gateway's CPU per call."""
    measured = timings(redis_url, calls=calls, rounds=rounds)
    low, ratio, high = quartiles(measured.ratios)
    direct, through = statistics.median(measured.direct) * 1000, statistics.median(measured.gateway) * 1000
    cpu = statistics.median(measured.gateway_cpu) * 1000
    tool = f"{DELAY * 1000:g} ms tool"
    return [
        Row(
            f"gateway: tools/call at a {tool}, HTTP (ms), median of {rounds} paired rounds' ratios "
            f"(quartiles {low:.2f}-{high:.2f})",
            through,
            direct,
            "<= 1.10",
            ratio <= 1.1,
            paired=ratio,
        ),
        Row(
            f"gateway: its process's CPU per call at a {tool} (ms), share of a direct call",
            cpu,
            direct,
            "<= 0.10",
            cpu <= 0.1 * direct,
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round each way")
    parser.add_argument("--rounds", type=int, default=15, help="paired rounds (at least 7)")
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    parser.add_argument("--no-intents", action="store_true", help="[gateway] intents = false: no awaited intent")
    parser.add_argument("--profile", type=Path, help="py-spy output of the gateway (.svg flame graph, .txt raw)")
    args = parser.parse_args(argv)
    if args.rounds < 7:
        parser.error("--rounds: at least 7, so the median and quartiles of the ratios mean something")
    from mcp_saga.cli.redis_server import resolve_redis

    load = os.getloadavg()[0]
    with resolve_redis(args.redis) as url:
        measured = timings(url, calls=args.calls, rounds=args.rounds, intents=not args.no_intents, profile=args.profile)
    ratios = measured.ratios
    low, ratio, high = quartiles(ratios)
    direct, through = statistics.median(measured.direct), statistics.median(measured.gateway)
    cpu = statistics.median(measured.gateway_cpu)
    cpus = [c * 1000 for c in measured.gateway_cpu]
    print(f"tool sleeps {DELAY * 1000:g} ms, streamable HTTP, {args.rounds} paired rounds (AB, BA, ...)")
    print(f"of {args.calls} calls each way; intents {'off' if args.no_intents else 'on'}")
    print(f"load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at the end")
    print(f"{'direct call ms':28}{direct * 1000:10.3f}   (median round)")
    print(f"{'through gateway ms':28}{through * 1000:10.3f}   (median round)")
    print(f"{'ratio, median of rounds':28}{ratio:10.3f}   quartiles {low:.3f}-{high:.3f}")
    print(f"{'':28}{'':10}   range {min(ratios):.3f}-{max(ratios):.3f}")
    print(f"{'gateway CPU ms/call':28}{cpu * 1000:10.3f}   rounds {min(cpus):.3f}-{max(cpus):.3f}")
    print(f"{'gateway CPU / direct call':28}{cpu / direct:10.3f}   {measured.kernel_share:.0%} of it in the kernel")
    print("rounds' ratios: " + " ".join(f"{r:.2f}" for r in ratios))


if __name__ == "__main__":
    main(sys.argv[1:])
