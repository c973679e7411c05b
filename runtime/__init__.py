"""What every mcp-saga process shares at run time: structured logs, the SEP-3172 wire helpers for MCP,
warm MCP sessions, the event publisher, fault-injection points. Above the contracts, below the
coordinator, workers, SDK and gateway."""
