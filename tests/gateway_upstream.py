"""An upstream with more than tools, for the gateway's forwarding tests: a resource, a prompt, progress, what it saw.

python -m tests.gateway_upstream --http PORT [--host HOST]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("extras", log_level="WARNING")


@app.resource("note://hello", description="a fixed note")
def hello() -> str:
    return "hello through the gateway"


@app.prompt()
def greet(name: str) -> str:
    """Greet someone."""
    return f"Say hello to {name}."


@app.tool()
async def count(to: int, ctx: Context) -> dict[str, int]:
    """Count up, reporting progress at each number."""
    for n in range(1, to + 1):
        await ctx.report_progress(n, to, f"at {n}")
    return {"counted": to}


@app.tool()
async def hold(marker: str) -> str:
    """Wait until cancelled, leaving `marker`.started and then `marker`.cancelled as evidence."""
    Path(marker + ".started").touch()
    try:
        await anyio.sleep(60)
    except anyio.get_cancelled_exc_class():
        Path(marker + ".cancelled").touch()
        raise
    return "not cancelled"


@app.tool()
def whoami(ctx: Context) -> dict[str, str | None]:
    """The clientInfo the caller introduced itself with."""
    params = ctx.request_context.session.client_params
    info = params.client_info if params is not None else None
    return {"name": info.name if info else None, "version": info.version if info else None}


@app.tool()
def seen(ctx: Context) -> dict[str, object]:
    """The HTTP headers and the request `_meta` this call reached the server with."""
    request = ctx.request_context.request
    headers = dict(request.headers) if request is not None else {}
    return {"headers": headers, "meta": dict(ctx.request_context.meta or {})}


@app.tool()
async def grow(ctx: Context) -> dict[str, str]:
    """Add a tool, and tell the client its tool list changed."""

    def grown() -> str:
        return "new"

    app.add_tool(grown, name="grown")
    await ctx.request_context.session.send_tool_list_changed()
    return {"added": "grown"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    app.run("streamable-http", host=args.host, port=args.http)
