"""What every `saga` subcommand needs from its arguments: the Redis URL, the config, a one-line error."""

from __future__ import annotations

import argparse
import os

from mcp_saga.schemas.config import Config, load_config


class CliError(Exception):
    """A one-line message for the user; the command exits non-zero."""


def redis_url(args: argparse.Namespace) -> str:
    url = getattr(args, "redis", None) or os.environ.get("REDIS_URL")
    if not url:
        raise CliError("no Redis: pass --redis URL or set REDIS_URL")
    return url


def config_of(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))
