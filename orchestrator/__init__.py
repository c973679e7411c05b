"""The publishing side for Python agents: the `workflow` wrapper (plain publishers live in runtime)."""

from mcp_saga.orchestrator.wrapper import StepNotRecorded, ToolCallFailed, Workflow, forget_declarations, workflow
from mcp_saga.runtime.publish import AsyncPublisher, Publisher

__all__ = [
    "AsyncPublisher",
    "Publisher",
    "StepNotRecorded",
    "ToolCallFailed",
    "Workflow",
    "forget_declarations",
    "workflow",
]
