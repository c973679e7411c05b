"""Planning one step's compensation from its step-completed event: pure, no I/O.

Planning happens when the step is recorded, not when the workflow fails: everything it needs
(the recovery declaration, the original arguments and result) is in the event, and an operator
can see before any failure which steps could not be undone. The plan is final: the coordinator
never calls with partial or default arguments (SEP-3172 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from mcp_saga.schemas.config import Policy
from mcp_saga.schemas.events import StepCompleted
from mcp_saga.schemas.expressions import UnresolvableError, resolve_parameters
from mcp_saga.schemas.records import Compensation, idempotency_key
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery

_encoder = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True, slots=True)
class Plan:
    compensation: Compensation
    # Things the timeline should say beside the plan (e.g. an overlay overriding the server).
    notes: tuple[str, ...] = ()


def plan_step(
    workflow: str, step: StepCompleted, seq: int, overlay: Recovery | None, now: float, policy: Policy | None = None
) -> Plan:
    notes: list[str] = []
    declared: Recovery | None = None
    problem: str | None = None
    if step.recovery is not None:
        parsed = _declaration(step.recovery)
        if isinstance(parsed, Recovery):
            declared = parsed
        else:
            problem = f"the step's recovery declaration is invalid: {parsed}"

    base = Compensation(step=step.step, seq=seq, server=step.server, tool=step.tool, status="pending", updated_at=now)
    if overlay is not None:
        if declared is not None and declared.to_wire() != overlay.to_wire():
            notes.append(
                f"overlay for {step.server}:{step.tool} overrides the server's declaration "
                f"(server: {declared.to_wire()}, overlay: {overlay.to_wire()})"
            )
        recovery, source, problem = overlay, "overlay", None
    elif declared is not None:
        recovery, source = declared, "server"
    elif problem is not None:
        return Plan(_mark(base, "unrecoverable", problem, "server"), tuple(notes))
    else:
        return Plan(_mark(base, "skipped", "no recovery in the event, and no overlay for the tool", None), tuple(notes))

    reason = recovery.unsupported_reason()
    if reason is not None:
        return Plan(_mark(base, "unrecoverable", reason, source), tuple(notes))
    operation = recovery.compensating_operation
    assert operation is not None  # unsupported_reason() covers the None case
    base.operation_id = operation.operation_id
    base.source = source  # type: ignore[assignment]
    refusal = (policy or Policy()).self_inverse_refusal(step.server, step.tool, operation.operation_id, source)
    if refusal is not None:
        return Plan(_mark(base, "unrecoverable", refusal, source), tuple(notes))
    try:
        base.arguments = resolve_parameters(operation.parameters, arguments=step.arguments, result=step.result)
    except UnresolvableError as exc:
        return Plan(_mark(base, "unrecoverable", f"recovery unavailable: {exc}", source), tuple(notes))
    base.idempotency_key = idempotency_key(workflow, step.step, operation.operation_id)
    return Plan(base, tuple(notes))


_declarations: dict[bytes, Recovery | RecoveryError] = {}


def _declaration(data: dict) -> Recovery | RecoveryError:
    """Parse a declaration once per distinct text: every step of one tool carries the same one."""
    key = _encoder.encode(data)
    found = _declarations.get(key)
    if found is None:
        if len(_declarations) >= 4096:
            _declarations.clear()
        try:
            found = parse_recovery(data)
        except RecoveryError as exc:
            found = exc
        _declarations[key] = found
    return found


def _mark(comp: Compensation, status: str, reason: str, source: str | None) -> Compensation:
    comp.status = status  # type: ignore[assignment]
    comp.reason = reason
    comp.source = source  # type: ignore[assignment]
    return comp
