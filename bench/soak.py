"""Soak: many workflows with no fault at all, to see that Redis gives back what it was lent.

    python -m bench.soak [--workflows 20000] [--publishers 4] [--concurrency 10] [--json PATH]

Issue 11's soak: 20,000 workflows (10% failing), retention 15 s, two coordinators, two workers,
the example servers over streamable HTTP. It is the chaos run (bench/chaos/) with every fault
turned off and the scale turned up, so the same verifier checks the same promises against the
servers' own ledgers: every failed workflow compensated once, in LIFO order; after retention,
0 per-workflow keys, 0 stale index or deadline entries, and Redis memory back near its start
plus RQ's own job records. It prints the throughput (events/s through the coordinators) and the
peak and final memory, which README (Guarantees) quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench.chaos import Report, Settings, print_report, run_chaos

NO_FAULTS = dict(
    kills=0, server_restarts=0, redis_restarts=0, crashes_after_call=0, stalls=0, blackholes=0, fills=0, wipes=0,
    fail_rate=0.0,
)  # fmt: skip


def soak_settings(workflows: int, publishers: int, concurrency: int, seed: int | None = None) -> Settings:
    """The soak's run: the issue's shape, with waits long enough for its scale."""
    return Settings(
        workflows=workflows, publishers=publishers, concurrency=concurrency, coordinators=2, workers=2,
        fail_share=0.1, retention=15, publish_timeout=4 * 3600.0, settle_timeout=600.0, expiry_timeout=300.0,
        seed=seed, **NO_FAULTS,
    )  # fmt: skip


def figures(report: Report) -> list[tuple[str, str]]:
    """The soak's own figures, beside the chaos table's rows."""
    rate = report.events_added / report.publish_seconds if report.publish_seconds else 0.0
    return [
        ("events/s", f"{rate:,.0f} ({report.events_added:,} events in {report.publish_seconds:.0f} s of publishing)"),
        ("workflows/s", f"{report.workflows / report.publish_seconds:.1f}" if report.publish_seconds else "-"),
        ("redis memory", f"{report.memory_before / 1e6:.2f} MB at start, {report.memory_peak / 1e6:.2f} MB peak, "
                         f"{report.memory_after / 1e6:.2f} MB final ({report.rq_bytes_after / 1e6:.2f} MB of it RQ "
                         "job records)"),
        ("per-workflow keys after", str(report.workflow_keys_after)),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workflows", type=int, default=20_000)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=10, help="workflows in flight per publisher")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    report = run_chaos(soak_settings(args.workflows, args.publishers, args.concurrency, args.seed))
    print_report(report)
    print()
    for name, value in figures(report):
        print(f"{name}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
