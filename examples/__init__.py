"""Demo MCP servers for SEP-3172's reference scenario, each runnable as `python -m mcp_saga.examples.<name>`."""

# Module paths rather than modules, so that naming the servers does not import the MCP SDK.
SERVERS: dict[str, str] = {
    "inventory": "mcp_saga.examples.inventory",
    "payments": "mcp_saga.examples.payments",
    "shipping": "mcp_saga.examples.shipping",
}
TRIVIAL = "mcp_saga.examples.trivial"
