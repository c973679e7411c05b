"""Operator commands (`retry`, `resolve`, `skip`, `approve`): which event each sends, and when one is pointless.

One rule set for the coordinator, which applies a command, and for every front end (the `saga`
command, the web console), which refuses to send a command that would be ignored and says why.
"""

from __future__ import annotations

from mcp_saga.schemas.events import (
    OperatorApprove,
    OperatorCommand,
    OperatorResolve,
    OperatorRetry,
    OperatorSkip,
)
from mcp_saga.schemas.records import Compensation

COMMANDS: dict[str, type[OperatorCommand]] = {
    "retry": OperatorRetry,
    "resolve": OperatorResolve,
    "skip": OperatorSkip,
    "approve": OperatorApprove,
}
# An in-doubt step is retried as a re-call of its tool with the forward key: the operator knows
# (and has declared, e.g. `idempotent = [...]` in the config) that the tool honours the key.
RETRYABLE = ("failed", "awaiting-approval", "unrecoverable", "in-doubt")
# Record statuses in which resolve / skip would change nothing.
FINAL_FOR = {"resolve": ("succeeded", "resolved"), "skip": ("succeeded", "resolved", "skipped")}


def operator_refusal(command: str, comp: Compensation) -> str | None:
    """Why an operator command (retry, resolve, skip, approve) would change nothing for this record.

    One rule set for the coordinator, which applies the command, and `saga`, which refuses to send
    a command that would be ignored and says why.
    """
    step, status = comp.step, comp.status
    if command == "retry":
        if status not in RETRYABLE:
            return (
                f"step {step!r} is {status}; retry applies to a failed, awaiting-approval, unrecoverable "
                "or in-doubt step"
            )
        if comp.operation_id is None or comp.arguments is None:
            why = f" ({comp.reason})" if comp.reason else ""
            return f"step {step!r} has no usable compensation to retry{why}; resolve or skip it instead"
    elif status in FINAL_FOR.get(command, ()):
        return f"step {step!r} is already {status}"
    elif command == "approve":
        if comp.approved:
            return f"step {step!r} is already approved"
        if comp.operation_id is None:
            why = f" ({comp.reason})" if comp.reason else ""
            return f"step {step!r} has no compensating operation to approve{why}"
        if status in ("succeeded", "skipped", "resolved"):
            return f"step {step!r} is {status}; there is nothing left to approve"
    return None
