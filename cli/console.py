"""`saga console`: serve the web console (mcp_saga.console) with uvicorn."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mcp_saga.cli.args import CliError, config_of, redis_url
from mcp_saga.runtime.logs import get_logger

log = get_logger("console")


def cmd_console(args: argparse.Namespace) -> int:
    import uvicorn
    from mcp_saga.console import Credentials, create_app
    from mcp_saga.console.auth import TOKEN_ENV, USERS_ENV, CredentialsError
    from mcp_saga.runtime.connect import connect, connect_queue
    from mcp_saga.schemas.config import ConsoleSettings
    from pydantic import ValidationError

    config = config_of(args)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:  # validated like the file's [console] table (model_copy would not check the flags)
        settings = ConsoleSettings.model_validate(config.console.model_dump() | overrides)
    except ValidationError as exc:
        raise CliError("; ".join(f"--{e['loc'][0]}: {e['msg']}" for e in exc.errors())) from None
    try:
        credentials = Credentials.from_env()
    except CredentialsError as exc:
        raise CliError(str(exc)) from None
    if not credentials.configured and not settings.read_open:
        raise CliError(
            f"no credentials: set {TOKEN_ENV} (bearer token) or {USERS_ENV} (name:password,...) "
            "or, for a look-only console, `[console] read_open = true`"
        )
    client = connect(redis_url(args), config.redis, socket_timeout=5, health_check_interval=30)
    queue = connect_queue(redis_url(args), config.redis, socket_timeout=5) if config.redis.queue_url else None
    app = create_app(client, config.keys(), settings, credentials, queue=queue)
    log.info("console listening", url=f"http://{settings.host}:{settings.port}/", read_open=settings.read_open)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning", access_log=False)
    return 0


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("console", help="serve the web console (workflows, unwinds, actions, fleet)")
    common(p)
    p.add_argument("--host", help="address to listen on (default: [console] host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: [console] port, 8780)")
    p.set_defaults(run=cmd_console)
