"""The command line every example server shares, so the demo, tests and config start them alike.

    python -m examples.<server> [--http PORT] [--host 127.0.0.1] [--db PATH]
                                [--fail-rate X] [--fail-first N] [--delay S]

Without `--http` the server speaks stdio; with it, streamable HTTP at `http://HOST:PORT/mcp`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp_saga.examples.ledger import Faults, Ledger, db_path
from mcp_types import ToolAnnotations

LOG_LEVEL = "WARNING"  # stdio servers share stderr with their parent; keep it for real trouble


def parse_args(server: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m examples.{server}", description=f"SEP-3172 demo server: {server}")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP (default: stdio)")
    parser.add_argument("--host", default="127.0.0.1", metavar="HOST", help="HTTP bind address (default: %(default)s)")
    parser.add_argument("--db", metavar="PATH", help="SQLite state file (default: $SAGA_EXAMPLE_DB, else a temp file)")
    parser.add_argument(
        "--fail-rate", type=float, metavar="X", help="share of compensating calls that fail transiently"
    )
    parser.add_argument("--fail-first", type=int, metavar="N", help="the first N calls of each compensating tool fail")
    parser.add_argument("--delay", type=float, metavar="S", help="seconds each compensating call takes")
    args = parser.parse_args(argv)
    args.faults = Faults.from_env(args.fail_rate, args.fail_first, args.delay)
    if not 0 <= args.faults.rate <= 1 or args.faults.first < 0:
        parser.error("--fail-rate must be within 0..1 and --fail-first at least 0")
    return args


def open_ledger(server: str, args: argparse.Namespace) -> Ledger:
    return Ledger(db_path(server, args.db), faults=args.faults)


def new_app(name: str, ledger: Ledger | None = None) -> MCPServer:
    """An `MCPServer` with quiet logs and, when it has a ledger, a read-only `state` tool."""
    app = MCPServer(name, log_level=LOG_LEVEL)
    if ledger is not None:

        @app.tool(annotations=ToolAnnotations(readOnlyHint=True))
        def state() -> dict[str, Any]:
            """This server's holdings, a count per status, and the append-only effect ledger."""
            return ledger.state()

    return app


def run(app: MCPServer, args: argparse.Namespace) -> None:
    if args.http is None:
        app.run()
    else:
        app.run("streamable-http", host=args.host, port=args.http)


def main_for(server: str, build: Callable[[Ledger], MCPServer], argv: Sequence[str] | None = None) -> None:
    args = parse_args(server, argv)
    run(build(open_ledger(server, args)), args)
