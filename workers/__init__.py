"""Workers: perform compensations over MCP, one RQ job each, with warm sessions and the trust policy."""
