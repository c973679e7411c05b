"""The publishing side for Python agents: the `workflow` wrapper and plain publishers."""

from .publish import AsyncPublisher, Publisher
from .wrapper import StepNotRecorded, ToolCallFailed, Workflow, forget_declarations, workflow

__all__ = [
    "AsyncPublisher",
    "Publisher",
    "StepNotRecorded",
    "ToolCallFailed",
    "Workflow",
    "forget_declarations",
    "workflow",
]
