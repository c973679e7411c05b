"""In-doubt steps in the pure machine: an intent (step-started) with no result when the workflow unwinds."""

from __future__ import annotations

import pytest
from mcp_saga.coordinator.machine import Machine, Rejected
from mcp_saga.coordinator.planner import IN_DOUBT_BINDS_RESPONSE
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import (
    CompensationSucceeded,
    OperatorRetry,
    OperatorSkip,
    RecallFailed,
    RecallSucceeded,
    StepCompleted,
    StepStarted,
    WorkflowFailed,
)
from mcp_saga.schemas.records import forward_key
from test_machine import RESERVE, fold, new_view

BY_ORDER = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "refund_order", "parameters": {"orderId": "$request.body#/orderId"}},
}
WF = "order-1"


def started(name: str, recovery=RESERVE, annotations=None, tool: str = "reserve_inventory") -> StepStarted:
    return StepStarted(
        step=name,
        server="inventory",
        tool=tool,
        forward_key=forward_key(WF, name),
        arguments={"orderId": f"O-{name}", "sku": "A"},
        recovery=recovery,
        annotations=annotations,
    )


def completed(name: str, recovery=RESERVE, tool: str = "reserve_inventory") -> StepCompleted:
    return StepCompleted(
        step=name,
        server="inventory",
        tool=tool,
        arguments={"orderId": f"O-{name}", "sku": "A"},
        result={"structuredContent": {"reservationId": f"R-{name}"}},
        recovery=recovery,
    )


@pytest.fixture
def machine() -> Machine:
    coordinator = {"barrier_grace": 5, "watchdog_after": 10, "claim_idle_ms": 1000, "in_doubt_after": 50}
    return Machine(parse_config({"coordinator": coordinator, "worker": {"backoff_max": 5}}))


def test_a_settled_intent_is_an_ordinary_step_at_the_place_of_its_intent(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), started("b"), completed("b"), completed("a"))
    assert [view.comps[s].status for s in "ab"] == ["pending", "pending"]
    assert view.state.steps == 2 and set(view.set_steps) == {0, 1}  # the stack entries now hold the results
    fold(machine, view, WorkflowFailed(reason="x", steps_completed=2))
    assert [j.step for j in view.jobs] == ["b"]  # LIFO by intent: b started after a
    assert view.jobs[0].kind == "compensation" and view.jobs[0].arguments == {"reservationId": "R-b"}


def test_an_intent_without_result_that_binds_the_response_needs_attention(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), completed("a"), started("b"))
    fold(machine, view, WorkflowFailed(reason="transport error", steps_completed=1))
    b = view.comps["b"]
    assert (b.status, b.in_doubt, b.reason) == ("in-doubt", True, IN_DOUBT_BINDS_RESPONSE)
    assert view.state.status == "needs-attention" and "step b: in-doubt" in view.state.attention
    assert not view.jobs  # halted above a: nothing below an unknown outcome is undone
    fold(machine, view, OperatorSkip(step="b", note="the charge never happened"))
    assert [j.step for j in view.jobs] == ["a"]


def test_request_only_bindings_compensate_with_the_calls_arguments(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", BY_ORDER, tool="charge"), WorkflowFailed(reason="timeout"))
    assert view.comps["a"].in_doubt and view.state.status == "compensating"
    (job,) = view.jobs
    assert (job.kind, job.operation_id, job.arguments) == ("compensation", "refund_order", {"orderId": "O-a"})


def test_an_idempotent_tool_is_called_again_and_its_result_planned(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", annotations={"idempotentHint": True}), WorkflowFailed(reason="t"))
    (job,) = view.jobs
    assert (job.kind, job.operation_id, job.idempotency_key) == ("recall", "reserve_inventory", forward_key(WF, "a"))
    assert job.arguments == {"orderId": "O-a", "sku": "A"}
    view.jobs.clear()
    result = {"structuredContent": {"reservationId": "R-first"}}
    fold(machine, view, RecallSucceeded(step="a", dispatch=job.dispatch, result=result))
    (undo,) = view.jobs
    assert (undo.kind, undo.operation_id) == ("compensation", "release_inventory")
    assert undo.arguments == {"reservationId": "R-first"}
    assert undo.dispatch == job.dispatch + 1
    fold(machine, view, CompensationSucceeded(step="a", dispatch=undo.dispatch))
    assert view.state.status == "compensated"


def test_an_error_from_the_recall_means_nothing_to_undo(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", annotations={"idempotentHint": True}), WorkflowFailed(reason="t"))
    result = {"isError": True, "content": [{"type": "text", "text": "out of stock"}]}
    fold(machine, view, RecallSucceeded(step="a", dispatch=1, result=result))
    a = view.comps["a"]
    assert a.status == "skipped" and "nothing to undo (out of stock)" in (a.reason or "")
    assert view.state.status == "compensated"


def test_a_recall_that_gets_no_answer_fails_and_can_be_retried(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", annotations={"idempotentHint": True}), WorkflowFailed(reason="t"))
    fold(machine, view, RecallFailed(step="a", dispatch=1, error="connection refused", retryable=True))
    assert view.comps["a"].status == "failed" and view.state.status == "needs-attention"
    view.jobs.clear()
    fold(machine, view, OperatorRetry(step="a"))
    assert [j.kind for j in view.jobs] == ["recall"]


def test_retry_of_an_in_doubt_step_recalls_it(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), WorkflowFailed(reason="t"))
    assert view.comps["a"].status == "in-doubt"
    fold(machine, view, OperatorRetry(step="a", note="the tool honours the key"))
    (job,) = view.jobs
    assert (job.kind, job.operation_id) == ("recall", "reserve_inventory")


def test_a_result_arriving_after_the_failure_settles_the_step(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), WorkflowFailed(reason="agent gave up"))
    assert view.state.status == "needs-attention"
    fold(machine, view, completed("a"))
    assert view.comps["a"].status == "queued" and view.jobs[0].arguments == {"reservationId": "R-a"}


def test_the_barrier_counts_completed_steps_not_intents(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), started("b"), WorkflowFailed(reason="x", steps_completed=1))
    assert view.state.status == "failed"  # a's or b's result is still on its way
    fold(machine, view, completed("a"))
    assert view.state.status == "needs-attention"  # b is in doubt: it binds the response
    assert view.comps["a"].status == "pending" and view.comps["b"].status == "in-doubt"


def test_an_agent_gone_mid_call_fails_its_workflow_after_in_doubt_after(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", annotations={"idempotentHint": True}), now=100.0)
    assert machine.next_deadline(view) == pytest.approx(150.0)
    machine.tick(view, 149.0)
    assert view.state.status == "running"
    machine.tick(view, 151.0)
    assert view.state.status == "compensating" and "presumed gone" in view.state.reason
    assert [j.kind for j in view.jobs] == ["recall"]


def test_a_settled_step_no_longer_keeps_the_idle_deadline(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"), completed("a"))
    assert machine.next_deadline(view) is None


def test_a_result_for_another_tool_than_the_intent_is_rejected(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a"))
    with pytest.raises(Rejected, match="its step-started named"):
        fold(machine, view, completed("a", tool="other"))


def test_no_recovery_means_nothing_to_undo_even_in_doubt(machine: Machine) -> None:
    view = fold(machine, new_view(), started("a", recovery=None), WorkflowFailed(reason="t"))
    assert view.comps["a"].status == "skipped" and view.state.status == "compensated"


def test_an_overlay_can_declare_a_tool_idempotent() -> None:
    config = parse_config({"servers": {"inventory": {"url": "http://x/mcp", "idempotent": ["reserve_inventory"]}}})
    view = fold(Machine(config), new_view(), started("a"), WorkflowFailed(reason="t"))
    assert [j.kind for j in view.jobs] == ["recall"]


def test_a_call_that_answered_an_error_does_not_count_as_a_completed_step(machine: Machine) -> None:
    """Found by the chaos run: b's events held by a dead coordinator, c's error answer counted, a undone first."""
    error = StepCompleted(step="c", server="inventory", tool="reserve_inventory", result={"isError": True})
    view = fold(machine, new_view(), started("a"), completed("a"), started("c"), error)
    assert view.comps["c"].status == "skipped"
    fold(machine, view, WorkflowFailed(reason="c failed", steps_completed=2))
    assert view.state.status == "failed" and not view.jobs  # b is still on its way: wait for it
    fold(machine, view, started("b"), completed("b"))
    assert [j.step for j in view.jobs] == ["b"]  # the last intent recorded is undone first


def test_an_error_answer_handled_before_its_intent_is_a_failed_call_too(machine: Machine) -> None:
    error = StepCompleted(step="c", server="inventory", tool="reserve_inventory", result={"isError": True})
    view = fold(machine, new_view(), started("a"), completed("a"), error, started("c"))
    c = view.comps["c"]
    assert (c.status, c.failed_call) == ("skipped", True)
    fold(machine, view, WorkflowFailed(reason="c failed", steps_completed=2))
    assert view.state.status == "failed"  # one completed step recorded of the two announced
