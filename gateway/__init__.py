"""The MCP gateway: an MCP server in front of the registry's servers that records every call made through it.

An agent, host or framework in any language changes only the URL (`/mcp/<server>`) or the stdio
command (`saga gateway --stdio <server>`) it connects to; each successful `tools/call` becomes a
step-completed on `saga:events`, so the coordinator can undo it when the workflow fails.
"""

from mcp_saga.gateway.app import http_app, serve_http, serve_stdio
from mcp_saga.gateway.proxy import COMPLETE_TOOL, FAIL_TOOL, Gateway

__all__ = ["COMPLETE_TOOL", "FAIL_TOOL", "Gateway", "http_app", "serve_http", "serve_stdio"]
