"""A step whose event carried no recovery, from a registered server, is planned from the live declaration.

Issue 13's "Also": such a step (a TypeScript publisher whose SDK stripped `annotations.recovery`)
used to end `skipped` with its effect in place. Now it waits, in its LIFO place, for a worker to
read the server's tools/list (a `declaration` job), and the pure planner plans it from that.
"""

from __future__ import annotations

import pytest
from mcp_saga.coordinator.machine import Machine
from mcp_saga.coordinator.planner import AWAITS_DECLARATION, NOT_IN_REGISTRY, READ_ONLY
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import (
    CompensationSucceeded,
    DeclarationFailed,
    DeclarationRead,
    OperatorRetry,
    StepCompleted,
    StepStarted,
    WorkflowFailed,
)
from mcp_saga.schemas.records import forward_key, idempotency_key
from test_machine import CHARGE, RESERVE, fold, new_view

WF = "order-1"
# 2026-12-02T00:00:00Z
LISTED_AT = 1796169600.0
BY_ORDER = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "release_inventory", "parameters": {"orderId": "$request.body#/orderId"}},
}


def config(**servers: dict) -> dict:
    registry = {"inventory": {"url": "http://inventory/mcp"}, "payments": {"url": "http://payments/mcp"}}
    coordinator = {"barrier_grace": 5, "watchdog_after": 10, "claim_idle_ms": 1000, "in_doubt_after": 50}
    return {"coordinator": coordinator, "worker": {"backoff_max": 5, "attempts": 2}, "servers": registry | servers}


@pytest.fixture
def machine() -> Machine:
    return Machine(parse_config(config()))


def reserve(name: str, recovery=None) -> StepCompleted:
    return StepCompleted(
        step=name,
        server="inventory",
        tool="reserve_inventory",
        arguments={"orderId": "O-1", "sku": "A"},
        result={"structuredContent": {"reservationId": f"R-{name}"}},
        recovery=recovery,
    )


def charge(name: str, recovery=None, server: str = "payments") -> StepCompleted:
    return StepCompleted(
        step=name,
        server=server,
        tool="charge_card",
        arguments={"orderId": "O-1", "amount": 5},
        result={"structuredContent": {"tx": f"T-{name}"}},
        recovery=recovery,
    )


def read(step: str, dispatch: int = 1, recovery=None, **fields) -> DeclarationRead:
    return DeclarationRead(step=step, dispatch=dispatch, recovery=recovery, listed_at=LISTED_AT, **fields)


def test_a_step_without_recovery_waits_for_the_live_declaration_and_is_undone_from_it(machine: Machine) -> None:
    view = fold(machine, new_view(), reserve("reserve"), charge("charge"))
    rec = view.comps["charge"]
    assert (rec.status, rec.kind, rec.reason) == ("pending", "declaration", AWAITS_DECLARATION)
    assert rec.arguments == {"orderId": "O-1", "amount": 5} and rec.result == {"structuredContent": {"tx": "T-charge"}}
    assert any(e.type == "step-planned" and e.reason == AWAITS_DECLARATION for e in view.log)

    fold(machine, view, WorkflowFailed(reason="ship failed"))
    (job,) = view.jobs
    assert (job.step, job.kind, job.server, job.operation_id) == ("charge", "declaration", "payments", "charge_card")
    assert view.comps["reserve"].status == "pending"  # below it, waiting its turn
    view.jobs.clear()

    fold(machine, view, read("charge", recovery=CHARGE), now=101.0)
    rec = view.comps["charge"]
    assert (rec.kind, rec.status, rec.source) == ("compensation", "queued", "server")
    (job,) = view.jobs  # planned exactly as if the event had carried it, and dispatched at once
    assert (job.kind, job.operation_id, job.arguments) == (
        "compensation",
        "refund_payment",
        {"transactionId": "T-charge"},
    )
    assert job.idempotency_key == idempotency_key(WF, "charge", "refund_payment")
    assert job.dispatch == 2
    entry = next(e for e in view.log if e.type == "declaration-read")
    assert "live declaration of charge_card, read at 2026-12-02T00:00:00Z" in (entry.detail or "")
    assert entry.plan == "pending" and entry.operation == "refund_payment"

    view.jobs.clear()
    fold(machine, view, CompensationSucceeded(step="charge", dispatch=2), now=102.0)
    (job,) = view.jobs  # the unwind goes on: reserve, which also needs its declaration read
    assert (job.step, job.kind) == ("reserve", "declaration")
    view.jobs.clear()
    fold(machine, view, read("reserve", recovery=RESERVE), now=103.0)
    (job,) = view.jobs
    assert (job.operation_id, job.arguments) == ("release_inventory", {"reservationId": "R-reserve"})
    fold(machine, view, CompensationSucceeded(step="reserve", dispatch=2), now=104.0)
    assert view.state.status == "compensated"


def test_a_tool_the_live_listing_declares_no_recovery_for_is_skipped_saying_so(machine: Machine) -> None:
    view = fold(machine, new_view(), reserve("reserve", RESERVE), charge("charge"), WorkflowFailed())
    view.jobs.clear()
    fold(machine, view, read("charge", annotations={"destructiveHint": True}), now=101.0)
    rec = view.comps["charge"]
    assert rec.status == "skipped"
    assert rec.reason == "the server declares no recovery for it, read live at 2026-12-02T00:00:00Z"
    (job,) = view.jobs  # and the unwind goes on below it
    assert (job.step, job.operation_id) == ("reserve", "release_inventory")


def test_a_tool_the_server_no_longer_lists_is_skipped_saying_so(machine: Machine) -> None:
    view = fold(machine, new_view(), charge("charge"), WorkflowFailed())
    fold(machine, view, read("charge", listed=False), now=101.0)
    assert view.comps["charge"].status == "skipped"
    assert "no longer lists the tool, read live at 2026-12-02T00:00:00Z" in (view.comps["charge"].reason or "")
    assert view.state.status == "compensated"


def test_an_invalid_live_declaration_is_unrecoverable_with_its_reason(machine: Machine) -> None:
    view = fold(machine, new_view(), charge("charge"), WorkflowFailed())
    fold(machine, view, read("charge", recovery={"strategy": "compensation"}), now=101.0)
    rec = view.comps["charge"]
    assert rec.status == "unrecoverable" and "without a compensatingOperation" in (rec.reason or "")
    assert view.state.status == "needs-attention"


def test_an_unlistable_server_is_retried_then_needs_attention_and_halts_the_unwind(machine: Machine) -> None:
    view = fold(machine, new_view(), reserve("reserve", RESERVE), charge("charge"), WorkflowFailed())
    view.jobs.clear()
    fold(
        machine,
        view,
        DeclarationFailed(step="charge", dispatch=1, attempt=1, final=False, error="refused", retryable=True),
    )
    rec = view.comps["charge"]
    assert (rec.status, rec.spent, rec.last_error) == ("running", 1, "declaration: refused")
    assert any(e.type == "declaration-attempt-failed" for e in view.log)
    fold(
        machine,
        view,
        DeclarationFailed(step="charge", dispatch=1, attempt=2, final=True, error="refused", retryable=True),
    )
    rec = view.comps["charge"]
    assert rec.status == "failed" and rec.kind == "declaration"
    assert (
        view.state.status == "needs-attention" and "step charge: failed (declaration: refused)" in view.state.attention
    )
    assert not view.jobs and view.comps["reserve"].status == "pending"  # halted, as a failed compensation halts

    fold(machine, view, OperatorRetry(step="charge"), now=200.0)
    (job,) = view.jobs  # an operator's retry reads the declaration again
    assert (job.kind, job.dispatch, job.attempts_used) == ("declaration", 2, 0)
    view.jobs.clear()
    fold(machine, view, read("charge", dispatch=2, recovery=CHARGE, attempt=1), now=201.0)
    (job,) = view.jobs  # the refund the read planned has the whole budget: the failed reads were not its own
    assert (job.operation_id, job.attempts_used) == ("refund_payment", 0)
    assert view.comps["charge"].attempts == 3  # every report counted once: two failed reads and the one that read


def test_a_server_not_in_the_registry_stays_skipped_with_a_reason_that_says_so(machine: Machine) -> None:
    view = fold(machine, new_view(), charge("charge", server="ledger"), WorkflowFailed())
    rec = view.comps["charge"]
    assert rec.status == "skipped" and rec.reason == NOT_IN_REGISTRY.format(server="ledger")
    assert not view.jobs and view.state.status == "compensated"


def test_a_step_its_event_declares_read_only_is_skipped_without_a_listing(machine: Machine) -> None:
    """A read-only call (the gateway's and SDKs' events carry the tool's other annotations) has no
    effect to undo: the unwind does not stop to list its server."""
    state = StepCompleted(
        step="look", server="payments", tool="state", result={}, recovery=None, annotations={"readOnlyHint": True}
    )
    view = fold(machine, new_view(), state, WorkflowFailed())
    assert (view.comps["look"].status, view.comps["look"].reason) == ("skipped", READ_ONLY)
    assert not view.jobs and view.state.status == "compensated"


def test_an_overlay_is_used_first_and_no_listing_is_read() -> None:
    machine = Machine(
        parse_config(config(payments={"url": "http://payments/mcp", "recovery": {"charge_card": CHARGE}}))
    )
    view = fold(machine, new_view(), charge("charge"), WorkflowFailed())
    (job,) = view.jobs
    assert (job.kind, job.operation_id, job.source) == ("compensation", "refund_payment", "overlay")


def test_a_read_for_a_step_planned_otherwise_meanwhile_changes_nothing(machine: Machine) -> None:
    view = fold(machine, new_view(), charge("charge"), WorkflowFailed())
    fold(machine, view, read("charge", recovery=CHARGE), now=101.0)
    planned = view.comps["charge"]
    fold(machine, view, read("charge", recovery=None), now=102.0)  # a redelivered or second report
    assert view.comps["charge"] is planned and planned.status == "queued"


def started(name: str, annotations=None) -> StepStarted:
    return StepStarted(
        step=name,
        server="inventory",
        tool="reserve_inventory",
        forward_key=forward_key(WF, name),
        arguments={"orderId": "O-1", "sku": "A"},
        recovery=None,
        annotations=annotations,
    )


def test_an_in_doubt_intent_without_recovery_is_planned_in_doubt_from_the_live_declaration(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"))
    rec = view.comps["a"]
    assert (rec.status, rec.kind, rec.if_in_doubt) == ("started", "declaration", "pending")
    fold(machine, view, WorkflowFailed(reason="transport error", steps_completed=0))
    (job,) = view.jobs
    assert (job.kind, view.comps["a"].in_doubt) == ("declaration", True)
    view.jobs.clear()
    # A declaration that binds only the request: the compensation runs with the call's arguments.
    fold(machine, view, read("a", recovery=BY_ORDER), now=101.0)
    (job,) = view.jobs
    assert (job.kind, job.operation_id, job.arguments) == ("compensation", "release_inventory", {"orderId": "O-1"})
    assert view.comps["a"].in_doubt


def test_an_in_doubt_intent_whose_live_declaration_binds_the_response_is_recalled_or_in_doubt(
    machine: Machine,
) -> None:
    view = fold(machine, new_view(), started("a"), WorkflowFailed(steps_completed=0))
    fold(machine, view, read("a", recovery=RESERVE), now=101.0)
    assert view.comps["a"].status == "in-doubt"  # its arguments would be guessed: an operator decides

    view = fold(machine, new_view(), started("b"), WorkflowFailed(steps_completed=0))
    view.jobs.clear()
    fold(machine, view, read("b", recovery=RESERVE, annotations={"idempotentHint": True}), now=101.0)
    (job,) = view.jobs  # idempotent as listed live: called again with its forward key to learn its result
    assert (job.kind, job.operation_id, job.idempotency_key) == ("recall", "reserve_inventory", forward_key(WF, "b"))
    assert view.comps["b"].recovery == RESERVE  # what the recall's result is then planned with


def test_an_in_doubt_intent_the_live_listing_declares_nothing_for_is_skipped_saying_so(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), WorkflowFailed(steps_completed=0))
    fold(machine, view, read("a"), now=101.0)
    rec = view.comps["a"]
    assert rec.status == "skipped" and "declares no recovery for it, read live at" in (rec.reason or "")


def test_a_result_arriving_for_an_intent_awaiting_its_declaration_keeps_it_awaiting(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), reserve("a"))
    rec = view.comps["a"]
    assert (rec.status, rec.kind, rec.open_intent) == ("pending", "declaration", False)
    assert rec.result == {"structuredContent": {"reservationId": "R-a"}}
