"""mcp-saga. `saga.workflow`, `saga.Publisher`, ... re-export `orchestrator` lazily: the CLI and the
coordinator import this package and should not pay for the MCP client they never use."""

_ORCHESTRATOR = (
    "workflow",
    "Workflow",
    "ToolCallFailed",
    "StepNotRecorded",
    "Publisher",
    "AsyncPublisher",
    "forget_declarations",
)


def __getattr__(name: str) -> object:
    if name in _ORCHESTRATOR:
        import orchestrator

        return getattr(orchestrator, name)
    raise AttributeError(f"module 'saga' has no attribute {name!r}")
