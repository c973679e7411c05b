"""The Python SDK: `mcp_saga.workflow(...)` wraps MCP clients so each successful call publishes a step.

Its public names are re-exported by `mcp_saga` itself; plain publishers live in `mcp_saga.runtime.publish`.
"""
