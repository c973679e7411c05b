"""What every `saga` subcommand needs from its arguments: the Redis URL, the config, a one-line error."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import redis
from mcp_saga.runtime.connect import connect, connect_queue
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import Config, load_config
from mcp_saga.schemas.keys import Keys
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError


class CliError(Exception):
    """A one-line message for the user; the command exits non-zero."""


def redis_url(args: argparse.Namespace) -> str:
    url = getattr(args, "redis", None) or os.environ.get("REDIS_URL")
    if not url:
        raise CliError("no Redis: pass --redis URL or set REDIS_URL")
    return url


def config_of(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


@dataclass(frozen=True, slots=True)
class Ops:
    args: argparse.Namespace
    r: redis.Redis  # a RedisCluster with `[redis] cluster`
    keys: Keys
    config: Config
    queue: redis.Redis  # RQ's Redis (`[redis] queue_url`), else `r`

    @property
    def reader(self) -> Reader:
        return Reader(self.r, self.keys, self.queue)


def with_redis(fn: Callable[[Ops], int]) -> Callable[[argparse.Namespace], int]:
    """Give a command its Redis client, and turn an unreachable Redis into one line instead of a traceback."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        config = config_of(args)
        try:
            client = connect(redis_url(args), config.redis)
            queue = connect_queue(redis_url(args), config.redis) if config.redis.queue_url else client
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as exc:  # a cluster connects at once
            raise CliError(f"cannot reach Redis: {exc}") from None
        try:
            return fn(Ops(args, client, config.keys(), config, queue))
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise CliError(f"cannot reach Redis: {exc}") from None
        finally:
            for c in dict.fromkeys([client, queue]):
                c.close()

    return run


def positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= number <= 86_400:
        raise argparse.ArgumentTypeError(f"{value!r} must be within 0..86400 seconds")
    return number


def add_command(
    sub: argparse._SubParsersAction,
    common: Callable[[argparse.ArgumentParser], None],
    name: str,
    run: Callable[[argparse.Namespace], int],
    help: str,
) -> argparse.ArgumentParser:
    """A subcommand with the options every operator command shares (--redis, --config, --json)."""
    p = sub.add_parser(name, help=help, description=help)
    common(p)
    p.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
    p.set_defaults(run=run)
    return p
