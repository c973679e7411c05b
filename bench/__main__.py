"""The whole benchmark suite in one table: `python -m bench [--json PATH] [--quick]`.

Every figure is a ratio against a baseline measured in the same run on the same machine (absolute
times drift on shared machines): ingest against the minimal Redis consume loop, latency and unwind
against warm-session MCP calls, the worker against raw calls and RQ's own no-op jobs, the
publisher against a bare `call_tool`, the gateway against a direct call, ingest with a polled
console against ingest without, ingest and worker with metrics and tracing on against off. One
private redis-server serves every part.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from mcp_saga.cli.redis_server import resolve_redis
from rich.console import Console

from bench import console as console_cost
from bench import coordinator, gateway, latency, observability, publisher, worker
from bench.table import Row, print_table


def machine() -> str:
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line), ""
        )
    return f"{os.cpu_count()} cores ({model or platform.processor()}), Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the table as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller samples (a smoke run, not for the README)")
    args = parser.parse_args(argv)
    console = Console()
    started = time.perf_counter()
    scale = 0.3 if args.quick else 1.0
    rows: list[Row] = []
    with resolve_redis(None) as url:
        parts = [
            ("ingest and memory", lambda: coordinator.measure(url, int(500 * scale), 10, 3, 0)[0]),
            ("latency and unwind", lambda: latency.measure(url, max(100, int(1000 * scale)), max(5, int(20 * scale)))),
            ("reference scenario", lambda: latency.reference(url, max(100, int(500 * scale)))),
            ("worker throughput", lambda: worker.rows(url, jobs=int(600 * scale), calls=int(1200 * scale))),
            ("publisher overhead", lambda: publisher.rows(url, rounds=max(5, int(20 * scale)))),
            ("ingest with an open console", lambda: console_cost.measure(url, int(1000 * scale), 10, 3)),
            ("gateway overhead", lambda: gateway.rows(url, rounds=max(7, int(15 * scale)))),
            (
                "metrics and tracing cost",
                lambda: observability.rows(url, workflows=int(300 * scale), jobs=int(300 * scale), rounds=7),
            ),
        ]
        for title, run in parts:
            with console.status(f"measuring {title} ..."):
                part = run()
            console.print(f"[green]done[/] {title} ({time.perf_counter() - started:.0f} s so far)")
            rows += part
    print_table(rows, f"mcp-saga benchmarks: {machine()}, load average {os.getloadavg()[0]:.2f}", console)
    console.print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": [r.as_dict() for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
