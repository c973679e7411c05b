"""mcp-saga: a distributed saga coordinator for MCP tool calls (SEP-3172 recovery metadata).

This root is the Python SDK's public surface (`mcp_saga.workflow(...)`, `mcp_saga.Publisher`); the
parts live in subpackages mapped from the repository's top-level folders (see pyproject.toml):
`schemas` (the contracts), `runtime` (what every process shares), `coordinator`, `workers`,
`orchestrator`, `gateway` (side by side), `cli` (the `saga` command, on top).
"""

from mcp_saga.orchestrator.wrapper import StepNotRecorded, ToolCallFailed, Workflow, forget_declarations, workflow
from mcp_saga.runtime.publish import AsyncPublisher, Publisher

__version__ = "0.2.0"

__all__ = [
    "AsyncPublisher",
    "Publisher",
    "StepNotRecorded",
    "ToolCallFailed",
    "Workflow",
    "__version__",
    "forget_declarations",
    "workflow",
]
