"""What an open console costs the coordinator: ingest with `saga console` being polled vs without.

    python -m bench.console [--redis URL] [--workflows 1000] [--steps 10] [--repeat 3] [--rate 20 100]

The same drain as `bench.coordinator` (b): one in-process coordinator over N pre-published
step-completed events. For each `--rate` each repeat drains twice, without and then with a poller process requesting
console pages at that many requests/s (a mix of what open browsers ask for: mostly the live
fragment of a workflow being written, sometimes its full page, the workflow list, the fleet) from a
real `saga console` process on the same Redis. Target at the first rate (an operator's few open
pages): with / without >= 0.9. On a 2-core machine the console and the poller also compete for CPU
with the coordinator and Redis, so a high rate measures that contention more than Redis reads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from mcp_saga.cli.procs import free_port, saga_process, stop, wait_until_accepting
from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.schemas.config import parse_config, write_config
from redis import Redis

from bench.coordinator import PREFIX, clean, coordinator_drain, workload
from bench.table import Row, print_table

# What open browsers ask for: mostly the live fragment of a workflow being written, now and then a page.
PAGES = ["/workflows/order-00001/live?mark={mark}"] * 3 + ["/workflows/order-00001", "/workflows", "/fleet"]
TOKEN = "bench-console-token-0123456789"


def poll(base: str, rate: float, token: str) -> None:
    """Request the pages in turn at `rate` per second until SIGTERM, then print how many were answered.

    Like the browser, the live fragment is asked for with the last mark it returned, so it costs
    a full render only when the workflow changed.
    """
    import signal

    served = 0

    def done(*_: object) -> None:
        print(served, flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, done)
    print("ready", flush=True)
    headers = {"Authorization": f"Bearer {token}"}
    interval, start, n, mark = 1 / rate, time.monotonic(), 0, "-"
    while True:
        page = PAGES[n % len(PAGES)].replace("{mark}", mark)
        try:
            with urllib.request.urlopen(urllib.request.Request(base + page, headers=headers), timeout=10) as response:
                response.read()
                mark = response.headers.get("X-Saga-Mark") or mark
            served += 1
        except urllib.error.HTTPError as exc:  # 404 before the workflow exists is still a served request
            served += exc.code < 500
        n += 1
        time.sleep(max(0.0, start + n * interval - time.monotonic()))


def measure(url: str, workflows: int, steps: int, repeat: int, rates: tuple[float, ...] = (20, 100)) -> list[Row]:
    redis = Redis.from_url(url)
    entries = workload(workflows, steps)
    config = parse_config({"prefix": PREFIX, "coordinator": {"block_ms": 5}})
    workdir = Path(tempfile.mkdtemp(prefix="bench-console-"))
    write_config(config, workdir / "saga.toml")
    port = free_port()
    console = saga_process(
        "console",
        "--port",
        str(port),
        redis_url=url,
        config=workdir / "saga.toml",
        env={"SAGA_CONSOLE_TOKEN": TOKEN, "SAGA_LOG": "json"},
        log=workdir / "console.log",
    )
    without: list[float] = []
    polled: dict[float, list[float]] = {rate: [] for rate in rates}
    served: dict[float, list[float]] = {rate: [] for rate in rates}
    try:
        wait_until_accepting("127.0.0.1", port, console)
        coordinator_drain(redis, entries, config)  # warm-up: the first drain of a process is the slowest
        for _ in range(repeat):
            for rate in rates:  # alternating, so drift on a shared machine hits both sides alike
                without.append(coordinator_drain(redis, entries, config))
                poller = subprocess.Popen(
                    [sys.executable, "-m", "bench.console", "--poll", f"http://127.0.0.1:{port}", "--rate", str(rate)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                try:
                    assert poller.stdout is not None and poller.stdout.readline().strip() == "ready"
                    started = time.perf_counter()
                    polled[rate].append(coordinator_drain(redis, entries, config))
                    elapsed = time.perf_counter() - started
                finally:
                    poller.terminate()
                    out, _ = poller.communicate(timeout=10)
                served[rate].append(int(out.strip() or 0) / elapsed)
        clean(redis)
    finally:
        stop(console)
        redis.close()
    base = statistics.median(without)
    rows = [Row("(e) ingest, no console, events/s", base, None, "", None)]
    for n, rate in enumerate(rates):
        value = statistics.median(polled[rate])
        # The first rate is an operator's few open pages; higher ones show where CPU (2 cores shared by
        # coordinator, Redis, console and poller) runs out, and carry no target.
        target = n == 0
        rows.append(
            Row(
                f"(f) ingest, console polled {statistics.median(served[rate]):.0f} req/s, events/s",
                value,
                base,
                "f/e >= 0.9" if target else "(CPU-bound)",
                value / base >= 0.9 if target else None,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    parser.add_argument("--workflows", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="drains per rate; the median is reported")
    parser.add_argument("--rate", type=float, nargs="+", default=[20.0, 100.0], help="console requests/s while polled")
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the poller process itself
    args = parser.parse_args(argv)
    if args.poll:
        poll(args.poll, args.rate[0], TOKEN)
        return 0
    with resolve_redis(args.redis) as url:
        rows = measure(url, args.workflows, args.steps, args.repeat, tuple(args.rate))
    print_table(rows, f"coordinator ingest with and without an open console ({args.workflows * args.steps:,} events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
