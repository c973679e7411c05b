"""`python -m mcp_saga.workers --redis URL --config FILE`: the worker without the `saga` CLI (tests use it)."""

from __future__ import annotations

import argparse
import os
import sys

from mcp_saga.runtime.redis_checks import RedisSetupError
from mcp_saga.schemas.config import ConfigError, load_config
from mcp_saga.workers.process import run_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcp_saga.workers", description="Run one mcp-saga worker.")
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL"), help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--config", default=os.environ.get("SAGA_CONFIG"), help="TOML file (default: $SAGA_CONFIG)")
    parser.add_argument("--name", help="worker name (default: RQ's)")
    parser.add_argument("--burst", action="store_true", help="stop when the queue is empty")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if not args.redis or not args.config:
        parser.error("--redis and --config (or REDIS_URL and SAGA_CONFIG) are required")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return run_worker(args.redis, config, name=args.name, burst=args.burst, logging_level=args.log_level)
    except RedisSetupError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
