"""`saga gateway`, and the two lifecycle signals any app can send from a shell: `saga fail`, `saga complete`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mcp_saga.cli.args import CliError, config_of, redis_url


def cmd_gateway(args: argparse.Namespace) -> int:
    from mcp_saga.gateway import serve_http, serve_stdio

    config = config_of(args)
    if args.stdio:
        return serve_stdio(config, redis_url(args), args.stdio)
    return serve_http(config, redis_url(args), host=args.host, port=args.port)


def _signal(kind: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import redis
        from mcp_saga.runtime.connect import connect
        from mcp_saga.runtime.publish import Publisher

        config = config_of(args)
        publisher = Publisher(connect(redis_url(args), config.redis), config.prefix, config.redis.partitions)
        try:
            if kind == "fail":
                entry = publisher.workflow_failed(args.workflow, args.reason)
            else:
                entry = publisher.workflow_completed(args.workflow)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        except redis.RedisError as exc:
            raise CliError(f"could not publish: {exc}") from None
        print(f"workflow-{'failed' if kind == 'fail' else 'completed'} published for {args.workflow} ({entry})")
        return 0

    return run


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("gateway", help="MCP gateway: forward to the registry's servers and record every call")
    common(p)
    p.add_argument("--stdio", metavar="SERVER", help="serve one registry server over stdio instead of HTTP")
    p.add_argument("--host", help="HTTP bind address (default: [gateway] host)")
    p.add_argument("--port", type=int, help="HTTP port (default: [gateway] port)")
    p.set_defaults(run=cmd_gateway)

    p = sub.add_parser("fail", help="publish workflow-failed: undo the workflow's completed steps")
    common(p)
    p.add_argument("workflow")
    p.add_argument("--reason", required=True, help="why; kept on the timeline")
    p.set_defaults(run=_signal("fail"))

    p = sub.add_parser("complete", help="publish workflow-completed: nothing will be undone")
    common(p)
    p.add_argument("workflow")
    p.set_defaults(run=_signal("complete"))
