"""The publishing side for Python agents: the `workflow` wrapper and plain publishers."""

from .publish import AsyncPublisher, Publisher
from .wrapper import ToolCallFailed, Workflow, forget_declarations, workflow

__all__ = ["AsyncPublisher", "Publisher", "ToolCallFailed", "Workflow", "forget_declarations", "workflow"]
