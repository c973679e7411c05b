"""An upstream whose tools/list comes in pages, for the gateway's pagination test.

python -m tests.gateway_paged --http PORT [--host HOST]
"""

from __future__ import annotations

import argparse
from typing import Any

import mcp_types as types
import uvicorn
from mcp.server.lowlevel.server import Server

TOOLS = [f"tool_{n}" for n in range(5)]
PAGE = 2


async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
    start = int(params.cursor) if params is not None and params.cursor else 0
    page = TOOLS[start : start + PAGE]
    more = start + PAGE < len(TOOLS)
    tools = [types.Tool(name=name, input_schema={"type": "object"}) for name in page]
    return types.ListToolsResult(tools=tools, next_cursor=str(start + PAGE) if more else None)


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=params.name)])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    app = Server("paged", on_list_tools=list_tools, on_call_tool=call_tool)
    uvicorn.run(app.streamable_http_app(host=args.host), host=args.host, port=args.http, log_level="warning")
