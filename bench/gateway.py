"""What a tool call costs through `saga gateway` against the same call made directly, at a 2 ms tool.

    python -m bench.gateway [--calls 100] [--rounds 15] [--no-intents] [--intents-off-too] [--profile OUT.svg]
        [--redis URL]

The upstream is bench.publisher's server over streamable HTTP (one tool sleeping 2 ms that
declares its compensation); the gateway is a real `saga gateway` process in front of it, which
forwards each call and records it: the intent awaited before forwarding (one XADD round trip on the
call's path; `--no-intents` turns it off, `--intents-off-too` runs one gateway each way in the same rounds
to measure its share, as the suite's rows do), the step-completed after the answer.

On a shared machine the wall-clock of one run says more about the neighbours than about the code,
so the figures are built to resist load. Rounds are paired: each round is one batch of direct
calls and one through the gateway, back to back, the order alternating (AB, BA, AB, ...) so that
neither side always gets the warmer core; the figure is the median of the rounds' own ratios, with
their spread. Beside it, the gateway process's CPU per call (its threads' time on a CPU, from
`/proc/PID/task/*/schedstat`, in nanoseconds), which load stretches much less than wall-clock:
what the gateway adds to a call on a free core is about that CPU plus the intent's round trip.
`--profile` records the gateway with py-spy during the measured rounds (py-spy must be installed), only
while it holds the GIL: its CPU work, not its waits. `--loops asyncio,uvloop` runs one gateway per
event loop, and `--base-python` one more of an earlier version, all in the same rounds (each is then
also given as its rounds' ratios to the base's: time and CPU, median and quartiles).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.publisher import DELAY
from bench.table import Row

PREFIX = "benchgw"  # its own stream, deleted afterwards
INTENTS_OFF = "intents-off"  # the gateway measured beside the default one without the awaited intent


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
class Side:
    """One gateway's per-round figures: seconds per call through it, and its CPU seconds per call."""

    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    kernel_share: float = 0.0  # of its CPU over the whole run (warm-up included)


@dataclass
class Rounds:
    """Seconds per direct call in each round, and each gateway's figures in the same rounds."""

    direct: list[float]
    gateways: dict[str, Side]

    def ratios(self, name: str) -> list[float]:
        return [through / direct for direct, through in zip(self.direct, self.gateways[name].times, strict=True)]

    def intent_ms(self, name: str) -> tuple[float, float, float]:
        """Quartiles of the rounds' differences between gateway `name` and its intents-off twin, ms per call:
        the awaited intent's share of a call, measured in the same rounds."""
        on, off = self.gateways[name].times, self.gateways[INTENTS_OFF].times
        return quartiles([(a - b) * 1000 for a, b in zip(on, off, strict=True)])


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


async def measure(
    direct_url: str, gateways: dict[str, tuple[str, Callable[[], int]]], calls: int, rounds: int
) -> Rounds:
    """`gateways`: name -> (URL, its CPU counter). Each round runs the direct batch and one batch per
    gateway back to back, the order rotating from round to round (AB, BA, ... with one gateway)."""
    from mcp import Client
    from mcp_saga.schemas.events import WORKFLOW_META_KEY

    async with contextlib.AsyncExitStack() as stack:
        direct = await stack.enter_async_context(Client(direct_url))
        clients = {name: await stack.enter_async_context(Client(url)) for name, (url, _) in gateways.items()}

        async def run(client: Client, round_no: int, through: bool) -> float:
            meta = {WORKFLOW_META_KEY: f"bench-{round_no}"} if through else None
            start = time.perf_counter()
            for n in range(calls):
                await client.call_tool("work", {"n": n}, meta=meta)
            return (time.perf_counter() - start) / calls

        result = Rounds([], {name: Side() for name in gateways})

        async def batch(side: str, round_no: int) -> None:
            if side == "direct":
                seconds = await run(direct, round_no, False)
                if round_no >= 0:
                    result.direct.append(seconds)
                return
            cpu = gateways[side][1]
            before = cpu()
            seconds = await run(clients[side], round_no, True)
            if round_no >= 0:
                result.gateways[side].times.append(seconds)
                result.gateways[side].cpu.append((cpu() - before) / 1e9 / calls)

        order = ["direct", *gateways]
        for side in order:  # warm-up: sessions, connections, the gateways' tools/list caches
            await batch(side, -1)
        for i in range(rounds):
            for side in order[i % len(order) :] + order[: i % len(order)]:
                await batch(side, i)
    return result


def _profiler(pid: int, out: Path, rate: int = 250) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    command = [spy, "record", "--pid", str(pid), "--output", str(out), "--rate", str(rate), "--nonblocking", "--gil"]
    if out.suffix == ".txt":
        command += ["--format", "raw"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def timings(
    redis_url: str,
    *,
    calls: int,
    rounds: int,
    intents: bool = True,
    loops: tuple[str, ...] = ("asyncio",),
    profile: Path | None = None,
    profile_rate: int = 250,
    base_python: str | None = None,
    intents_off: bool = False,
) -> Rounds:
    """One gateway per event loop in `loops` (named by it), all before one upstream, measured in the same rounds.
    `intents_off`: one more, `intents-off`, on the first loop with `[gateway] intents = false`, so the same
    rounds separate the gateway's own overhead from the awaited intent's round trip."""
    import redis
    from mcp_saga.cli.procs import free_port, saga_process, start_http_server, stop, wait_until_accepting
    from mcp_saga.schemas.config import parse_config, write_config

    with (
        start_http_server("bench.publisher", "--serve") as (_, upstream),
        tempfile.TemporaryDirectory() as tmp,
        contextlib.ExitStack() as stack,
    ):
        processes, urls = {}, {}
        variants = [(loop, loop, intents) for loop in loops]
        if intents_off:
            variants.append((INTENTS_OFF, loops[0], False))
        for name, loop, with_intents in variants:
            port = free_port()
            gateway_settings: dict[str, object] = {"port": port, "allow_anonymous": True, "intents": with_intents}
            if loop != "base":
                gateway_settings["loop"] = loop
            settings = {"servers": {"bench": {"url": upstream}}, "gateway": gateway_settings}
            config = write_config(parse_config({"prefix": PREFIX, **settings}), Path(tmp) / f"{name}.toml")
            env = {"SAGA_LOG_LEVEL": "WARNING"}
            if loop == "base":  # an earlier version, installed for `base_python`, on its default loop
                environment = {**os.environ, "REDIS_URL": redis_url, "SAGA_CONFIG": str(config), **env}
                command = [base_python or "python", "-m", "mcp_saga.cli", "gateway"]
                process = subprocess.Popen(command, cwd=tmp, env=environment, stdout=subprocess.DEVNULL)
            else:
                process = saga_process("gateway", redis_url=redis_url, config=config, env=env)
            processes[name] = process
            stack.callback(stop, process)
            wait_until_accepting("127.0.0.1", port, process)
            urls[name] = f"http://127.0.0.1:{port}/mcp/bench"
        if profile is not None:
            spy = _profiler(processes[loops[0]].pid, profile, profile_rate)

            def stop_profiler() -> None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
                spy.wait(30)

            stack.callback(stop_profiler)
            time.sleep(1.0)  # attached before the rounds start
        try:
            before = {loop: user_system(process.pid) for loop, process in processes.items()}
            counters = {loop: (urls[loop], _cpu_counter(process.pid)) for loop, process in processes.items()}
            measured = asyncio.run(measure(upstream, counters, calls, rounds))
            for loop, process in processes.items():
                user, system = (now - then for now, then in zip(user_system(process.pid), before[loop], strict=True))
                measured.gateways[loop].kernel_share = system / ((user + system) or 1)
            return measured
        finally:
            client = redis.Redis.from_url(redis_url)
            client.delete(f"{PREFIX}:events")
            client.close()


def _cpu_counter(pid: int) -> Callable[[], int]:
    return lambda: cpu_ns(pid)


def rows(redis_url: str, *, calls: int = 100, rounds: int = 15) -> list[Row]:
    """The suite's rows: the median of paired rounds' ratios (through / direct), and the gateway's CPU per call;
    each also for a gateway with intents off in the same rounds, which separates the gateway's own overhead
    from the awaited intent's round trip (as the publisher's rows do), and their difference per call."""
    measured = timings(redis_url, calls=calls, rounds=rounds, intents_off=True)
    (loop,) = set(measured.gateways) - {INTENTS_OFF}
    side, off = measured.gateways[loop], measured.gateways[INTENTS_OFF]
    low, ratio, high = quartiles(measured.ratios(loop))
    off_low, off_ratio, off_high = quartiles(measured.ratios(INTENTS_OFF))
    direct, through = statistics.median(measured.direct) * 1000, statistics.median(side.times) * 1000
    cpu, off_cpu = statistics.median(side.cpu) * 1000, statistics.median(off.cpu) * 1000
    intent_low, intent, intent_high = measured.intent_ms(loop)
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
            f"gateway, intents off: tools/call at a {tool}, HTTP (ms), median of the same rounds' ratios "
            f"(quartiles {off_low:.2f}-{off_high:.2f})",
            statistics.median(off.times) * 1000,
            direct,
            "<= 1.10",
            off_ratio <= 1.1,
            paired=off_ratio,
        ),
        Row(
            "gateway: the awaited intent, per call (ms), median of the rounds' differences",
            intent,
            None,
            "reported",
            None,
            spread=(intent_low, intent_high),
        ),
        Row(
            f"gateway: its process's CPU per call at a {tool} (ms), share of a direct call",
            cpu,
            direct,
            "<= 0.10",
            cpu <= 0.1 * direct,
        ),
        Row(
            f"gateway, intents off: its process's CPU per call at a {tool} (ms), share of a direct call",
            off_cpu,
            direct,
            "reported",
            None,
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round each way")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (at least 7)")
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="default: $REDIS_URL, else a private one")
    parser.add_argument("--no-intents", action="store_true", help="[gateway] intents = false: no awaited intent")
    parser.add_argument(
        "--intents-off-too",
        action="store_true",
        help=f"one more gateway, `{INTENTS_OFF}`, with intents = false, in the same rounds (as the suite's rows)",
    )
    parser.add_argument(
        "--loops", default=None, help="one gateway per [gateway] loop named (comma-separated), in the same rounds"
    )
    parser.add_argument(
        "--base-python",
        help="one more gateway, `base`, run by this interpreter (a venv with an earlier version installed)",
    )
    parser.add_argument(
        "--profile", type=Path, help="py-spy output of the (first) gateway (.svg flame graph, .txt raw)"
    )
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default 250)")
    args = parser.parse_args(argv)
    if args.rounds < 7:
        parser.error("--rounds: at least 7, so the median and quartiles of the ratios mean something")
    from mcp_saga.cli.redis_server import resolve_redis
    from mcp_saga.schemas.config import GatewaySettings

    loops = tuple(args.loops.split(",")) if args.loops else (GatewaySettings().loop,)
    loops = (*loops, "base") if args.base_python else loops
    load = os.getloadavg()[0]
    with resolve_redis(args.redis) as url:
        measured = timings(
            url,
            calls=args.calls,
            rounds=args.rounds,
            intents=not args.no_intents,
            loops=loops,
            profile=args.profile,
            profile_rate=args.profile_rate,
            base_python=args.base_python,
            intents_off=args.intents_off_too,
        )
    direct = statistics.median(measured.direct)
    order = "AB, BA, ..." if len(measured.gateways) == 1 else "order rotating"
    print(f"tool sleeps {DELAY * 1000:g} ms, streamable HTTP, {args.rounds} rounds ({order}) of {args.calls} calls")
    print(f"each way; intents {'off' if args.no_intents else 'on'}; load average {load:.2f} at start, ", end="")
    print(f"{os.getloadavg()[0]:.2f} at the end")
    print(f"{'direct call ms':28}{direct * 1000:10.3f}   (median round)")
    for loop, side in measured.gateways.items():
        ratios = measured.ratios(loop)
        low, ratio, high = quartiles(ratios)
        cpu, cpus = statistics.median(side.cpu), [c * 1000 for c in side.cpu]
        if loop == "base":
            print("gateway of --base-python:")
        elif loop == INTENTS_OFF:
            print(f"gateway on the {loops[0]} loop, intents off:")
        else:
            print(f"gateway on the {loop} loop:")
        print(f"{'  through gateway ms':28}{statistics.median(side.times) * 1000:10.3f}   (median round)")
        print(f"{'  ratio, median of rounds':28}{ratio:10.3f}   quartiles {low:.3f}-{high:.3f}")
        print(f"{'':28}{'':10}   range {min(ratios):.3f}-{max(ratios):.3f}")
        print(f"{'  gateway CPU ms/call':28}{cpu * 1000:10.3f}   rounds {min(cpus):.3f}-{max(cpus):.3f}")
        print(f"{'  gateway CPU / direct call':28}{cpu / direct:10.3f}   {side.kernel_share:.0%} of it in the kernel")
        print("  rounds' ratios: " + " ".join(f"{r:.2f}" for r in ratios))
    if INTENTS_OFF in measured.gateways:  # the same rounds' differences: the intent's share of a call
        low, median, high = measured.intent_ms(loops[0])
        print(f"the awaited intent, ms per call, median of rounds' differences: {median:.3f} ({low:.3f}-{high:.3f})")
    if "base" in measured.gateways:  # each gateway against the base in the same round: the pairs' own ratios
        base = measured.gateways["base"]
        for loop, side in measured.gateways.items():
            if loop == "base":
                continue
            times = quartiles([a / b for a, b in zip(side.times, base.times, strict=True)])
            cpus = quartiles([a / b for a, b in zip(side.cpu, base.cpu, strict=True)])
            print(f"{loop} / base, median of rounds: time {times[1]:.3f} ({times[0]:.3f}-{times[2]:.3f}),", end="")
            print(f" CPU {cpus[1]:.3f} ({cpus[0]:.3f}-{cpus[2]:.3f}) (quartiles)")


if __name__ == "__main__":
    main(sys.argv[1:])
