"""Planning one step's compensation from its step-completed event: pure, no I/O.

Planning happens when the step is recorded, not when the workflow fails: everything it needs
(the recovery declaration, the original arguments and result) is in the event, and an operator
can see before any failure which steps could not be undone. The plan is final: the coordinator
never calls with partial or default arguments (SEP-3172 4.2).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
from mcp_saga.schemas.config import Policy
from mcp_saga.schemas.events import StepCompleted, StepStarted
from mcp_saga.schemas.expressions import (
    ExpressionError,
    Resolver,
    UnresolvableError,
    compile_parameters,
    referenced_pointers,
)
from mcp_saga.schemas.records import Compensation, idempotency_key
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery

_encoder = msgspec.json.Encoder(order="sorted")


class Plan(NamedTuple):
    """A NamedTuple, not a frozen dataclass: one is made per recorded step, and the dataclass's
    `__init__` (object.__setattr__ per field) cost more than the rest of the wrapper."""

    compensation: Compensation
    # Things the timeline should say beside the plan (e.g. an overlay overriding the server).
    notes: tuple[str, ...] = ()


NOT_IN_REGISTRY = (
    "no recovery in the event, no overlay for the tool, and server {server!r} is not in the registry, "
    "so its live declaration cannot be read"
)
READ_ONLY = "no recovery in the event, and the event's annotations declare the tool read-only: nothing to undo"
AWAITS_DECLARATION = (
    "no recovery in the event and no overlay for the tool: the server's live declaration is read when it unwinds"
)


def plan_step(
    workflow: str,
    step: StepCompleted,
    seq: int,
    overlay: Recovery | None,
    now: float,
    policy: Policy | None = None,
    registered: bool | None = None,
) -> Plan:
    """`registered`: whether the step's server is in the registry, so that a step whose event carried
    no recovery can wait for a worker to read the server's live declaration (None: that was done,
    or cannot be asked for; such a step is `skipped`)."""
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
    elif registered and (step.annotations or {}).get("readOnlyHint") is True:
        # Nothing to undo, and no listing to read for it: a read-only tool declares no compensation.
        return Plan(_mark(base, "skipped", READ_ONLY, None), tuple(notes))
    elif registered:
        return Plan(awaiting_declaration(workflow, step, base), tuple(notes))
    elif registered is False:
        return Plan(_mark(base, "skipped", NOT_IN_REGISTRY.format(server=step.server), None), tuple(notes))
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
        base.arguments = _resolver(recovery)(step.arguments, step.result)
    except UnresolvableError as exc:
        return Plan(_mark(base, "unrecoverable", f"recovery unavailable: {exc}", source), tuple(notes))
    base.idempotency_key = idempotency_key(workflow, step.step, operation.operation_id)
    return Plan(base, tuple(notes))


def awaiting_declaration(workflow: str, step: StepCompleted, comp: Compensation) -> Compensation:
    """A step whose event carried no recovery, from a registered server: pending a `declaration` job.

    It is not planned until it unwinds, in its LIFO place: a worker then reads the server's live
    tools/list, and the coordinator plans from that declaration with `plan_step` as if the event had
    carried it. The record keeps the recorded arguments and result that plan binds.
    """
    comp.kind, comp.reason = "declaration", AWAITS_DECLARATION
    comp.operation_id, comp.arguments, comp.result = step.tool, dict(step.arguments), step.result
    comp.idempotency_key = idempotency_key(workflow, step.step, "tools/list")
    return comp


def no_live_declaration(listed: bool, at: str) -> str:
    """Why a step planned from the live listing has nothing to undo."""
    if not listed:
        return f"the server no longer lists the tool, read live at {at}: no recovery can be declared for it"
    return f"the server declares no recovery for it, read live at {at}"


IN_DOUBT_BINDS_RESPONSE = "in doubt: the outcome is unknown and the compensation binds the response"
IN_DOUBT_ARGUMENTS_CUT = (
    "in doubt, and its intent was recorded without its arguments ({cut}): "
    "it can be neither called again nor undone without its result"
)
IN_DOUBT_RECALL = "in doubt: the tool is idempotent under its forward key; called again to learn its result"


def as_completed(step: StepStarted, result: dict | None = None) -> StepCompleted:
    """A started step seen as completed with `result` (none known: an empty one, which binds nothing)."""
    return StepCompleted(
        step=step.step,
        server=step.server,
        tool=step.tool,
        result=result or {},
        arguments=step.arguments,
        recovery=step.recovery,
        annotations=step.annotations,
        trace=step.trace,
    )


def plan_in_doubt(
    workflow: str,
    step: StepStarted,
    seq: int,
    overlay: Recovery | None,
    idempotent: bool,
    now: float,
    policy: Policy | None = None,
    arguments_cut: str | None = None,
    registered: bool | None = None,
) -> Plan:
    """A started step's record: status `started`, with the plan to follow if its outcome is never learned.

    Planned when the intent is recorded, like a completed step's plan, and used only if the
    workflow unwinds while the step is still open (`if_in_doubt` is the status it then takes). In
    order: a step with nothing to undo (no recovery) or an unusable declaration keeps that verdict;
    a tool idempotent under its forward key is called again to learn the result (a `recall`); a
    compensation whose bindings read only the request runs with them (a server must accept the
    undo of what never happened); anything else is `in-doubt` and waits for an operator, because
    its arguments would have to be guessed. The recall's fields (the tool, its arguments, the
    forward key) are kept in that last case too, so that an operator who learns that the tool
    honours the key can declare it idempotent and `saga retry` the step. `arguments_cut` (the
    repair note of an intent whose arguments were left out on decoding) rules the recall out: the
    recorded call is not the one made, so repeating it would guess its arguments.
    An intent with no recovery from a registered server (`registered`) waits, in doubt, for its
    server's live declaration like a completed step (`awaiting_declaration`); it is then planned
    again here with that declaration.
    """
    plan = plan_step(workflow, as_completed(step), seq, overlay, now, policy, registered)
    comp = plan.compensation
    comp.forward_key, comp.recovery, comp.open_intent = step.forward_key, step.recovery, True
    if comp.kind == "declaration":
        comp.if_in_doubt, comp.status = "pending", "started"  # type: ignore[assignment]
        comp.reason = f"in doubt, and {AWAITS_DECLARATION}"
        if arguments_cut is not None:  # whatever the server declares, its plan would bind guessed arguments
            fresh = Compensation(step.step, seq, step.server, step.tool, "started", updated_at=now)
            fresh.forward_key, fresh.open_intent, fresh.if_in_doubt = step.forward_key, True, "unrecoverable"
            fresh.reason = IN_DOUBT_ARGUMENTS_CUT.format(cut=arguments_cut)
            return Plan(fresh, plan.notes)
        return plan
    verdict = comp.status
    binds_response = _binds_response(overlay if overlay is not None else _declared(step))
    usable = comp.operation_id is not None and (comp.status == "pending" or binds_response)
    if usable and arguments_cut is not None and (idempotent or comp.status != "pending"):
        verdict, comp.reason = "unrecoverable", IN_DOUBT_ARGUMENTS_CUT.format(cut=arguments_cut)
    elif usable and (idempotent or comp.status != "pending"):
        comp.kind = "recall"
        comp.operation_id, comp.arguments, comp.idempotency_key = step.tool, dict(step.arguments), step.forward_key
        if idempotent:
            verdict, comp.reason = "pending", IN_DOUBT_RECALL
        else:
            verdict, comp.reason = "in-doubt", IN_DOUBT_BINDS_RESPONSE
    elif usable:
        comp.reason = "in doubt: the compensation binds only the request, so it runs with the call's arguments"
    comp.if_in_doubt, comp.status = verdict, "started"  # type: ignore[assignment]
    return plan


def _declared(step: StepStarted) -> Recovery | None:
    parsed = _declaration(step.recovery) if step.recovery is not None else None
    return parsed if isinstance(parsed, Recovery) else None


def _binds_response(recovery: Recovery | None) -> bool:
    """Whether any binding of the recovery reads the response (a binding that does not parse counts)."""
    operation = recovery.compensating_operation if recovery is not None else None
    if operation is None:
        return False
    try:
        return any(kind != "request.body" for _, kind, _ in referenced_pointers(operation.parameters))
    except ExpressionError:
        return True


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


# id of a declaration -> (the declaration, its compiled bindings); the declaration is kept so that its id
# is not reused while the entry lives. Declarations come from `_declarations` or the config's overlays.
_resolvers: dict[int, tuple[Recovery, Resolver]] = {}


def _resolver(recovery: Recovery) -> Resolver:
    """The declaration's bindings compiled once (see `compile_parameters`), not once per step."""
    found = _resolvers.get(id(recovery))
    if found is None or found[0] is not recovery:
        if len(_resolvers) >= 4096:
            _resolvers.clear()
        operation = recovery.compensating_operation
        assert operation is not None  # only a supported declaration is resolved
        found = _resolvers[id(recovery)] = (recovery, compile_parameters(operation.parameters))
    return found[1]


def _mark(comp: Compensation, status: str, reason: str, source: str | None) -> Compensation:
    comp.status = status  # type: ignore[assignment]
    comp.reason = reason
    comp.source = source  # type: ignore[assignment]
    return comp
