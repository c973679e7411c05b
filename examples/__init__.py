"""Demo MCP servers for SEP-3172's reference scenario, each runnable as `python -m examples.<name>`."""

# Module paths rather than modules, so that naming the servers does not import the MCP SDK.
SERVERS: dict[str, str] = {
    "inventory": "examples.inventory",
    "payments": "examples.payments",
    "shipping": "examples.shipping",
}
TRIVIAL = "examples.trivial"
