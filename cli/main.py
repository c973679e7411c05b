"""`saga`: one console command for every process and every operator action."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from mcp_saga.cli import act, check, console, demo, gateway, look
from mcp_saga.cli.args import CliError, config_of, redis_url
from mcp_saga.runtime.logs import configure
from mcp_saga.runtime.redis_checks import RedisSetupError
from mcp_saga.schemas.config import Config, ConfigError

if TYPE_CHECKING:
    from redis import Redis

Command = Callable[[argparse.Namespace], int]


def cmd_coordinator(args: argparse.Namespace) -> int:
    # A stop requested while the process is still starting is honoured too: exit 0, nothing read.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: early.append(signum))
    from mcp_saga.coordinator.partitions import run_partitions
    from mcp_saga.runtime.connect import connect, connect_queue

    config = config_of(args)
    connection = connect(redis_url(args), config.redis)
    queue = connect_queue(redis_url(args), config.redis) if config.redis.queue_url else connection
    observe(config, "coordinator", args, connection, queue)
    return 0 if early else run_partitions(connection, config, args.name, queue=queue, only=args.partition)


def cmd_worker(args: argparse.Namespace) -> int:
    from mcp_saga.workers.process import run_worker

    config = config_of(args)
    if not config.servers:
        raise CliError("a worker needs a config naming the MCP servers it may call (--config FILE or SAGA_CONFIG)")
    observe(config, "worker", args)
    return run_worker(redis_url(args), config, name=args.name, burst=args.burst)


def observe(
    config: Config,
    component: str,
    args: argparse.Namespace,
    connection: Redis | None = None,
    queue: Redis | None = None,
) -> None:
    """Traces when the OTEL_* variables ask for them; `/metrics` for the process's lifetime (a daemon
    thread) when `[metrics] port` or `--metrics-port` says so."""
    from mcp_saga.runtime import metrics, tracing

    tracing.setup(component)
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port {args.metrics_port}: a port is 1-65535")

    try:
        metrics.serve(
            config.metrics, component, port=args.metrics_port, redis=connection, keys=config.keys(), queue=queue
        )
    except OSError as exc:
        raise CliError(
            f"cannot serve metrics on {config.metrics.address}:{args.metrics_port or config.metrics.port}: {exc}"
        ) from None


def common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--config", help="TOML config file (default: $SAGA_CONFIG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saga", description="Saga coordinator for MCP tool calls (SEP-3172).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("coordinator", help="consume saga:events, keep workflow state, dispatch compensations")
    common(p)
    p.add_argument("--name", help="consumer name in the group (default: host-pid)")
    p.add_argument(
        "--partition",
        type=int,
        action="append",
        metavar="N",
        help="read only partition N (repeatable; default: every partition of [redis] partitions)",
    )
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics here (default: [metrics] port, else off)"
    )
    p.set_defaults(run=cmd_coordinator)

    p = sub.add_parser("worker", help="perform compensations from the RQ queue over MCP")
    common(p)
    p.add_argument("--name", help="worker name (default: RQ's)")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus /metrics here (default: [metrics] port, else off)"
    )
    p.set_defaults(run=cmd_worker)

    for module in (look, act, check, gateway, console, demo):
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure()
    try:
        return args.run(args)
    except (CliError, ConfigError, RedisSetupError) as exc:
        print(f"saga {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
