"""`python -m bench.chaos`: the full run, or (with --publish SPEC) one publisher process started by the run."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.chaos import __doc__ as DOC
from bench.chaos.agents import publish
from bench.chaos.model import Settings
from bench.chaos.run import print_report, run_chaos


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--publish"]:  # a publisher process, started by run_chaos
        asyncio.run(publish(json.loads(Path(argv[1]).read_text())))
        return 0
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=(DOC or "").splitlines()[0])
    parser.add_argument("--workflows", type=int, default=defaults.workflows)
    parser.add_argument("--publishers", type=int, default=defaults.publishers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="workflows in flight each")
    parser.add_argument("--kills", type=int, default=defaults.kills, help="SIGKILLs of coordinators and of workers")
    parser.add_argument("--server-restarts", type=int, default=defaults.server_restarts)
    parser.add_argument("--redis-restarts", type=int, default=defaults.redis_restarts)
    parser.add_argument("--coordinators", type=int, default=defaults.coordinators)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--fail-share", type=float, default=defaults.fail_share, help="share of workflows failing")
    parser.add_argument("--fail-rate", type=float, default=defaults.fail_rate, help="transient compensation errors")
    parser.add_argument("--retention", type=int, default=defaults.retention, help="seconds settled workflows stay")
    parser.add_argument("--cluster", action="store_true", help="on a local Redis Cluster, a primary SIGKILLed mid-run")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--workdir", help="keep processes' logs and ledgers here")
    parser.add_argument("--keep", action="store_true", help="keep the working directory even when all is well")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    settings = Settings(
        workflows=args.workflows, publishers=args.publishers, concurrency=args.concurrency, kills=args.kills,
        server_restarts=args.server_restarts, redis_restarts=args.redis_restarts,
        coordinators=args.coordinators, workers=args.workers, fail_share=args.fail_share, fail_rate=args.fail_rate,
        retention=args.retention, seed=args.seed, workdir=args.workdir, keep=args.keep,
    )  # fmt: skip
    if args.cluster:  # the one Redis's restarts, fill and wipe do not apply to a cluster's nodes
        settings = replace(settings, redis_cluster=True, primary_kills=1, redis_restarts=0, fills=0, wipes=0)
    report = run_chaos(settings)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
