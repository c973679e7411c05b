"""The workflow state machine, folded event by event without Redis."""

from __future__ import annotations

import math

import pytest
from mcp_saga.coordinator.machine import Machine, Rejected, WorkflowView
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import (
    CompensationFailed,
    CompensationRefused,
    CompensationSucceeded,
    Event,
    OperatorApprove,
    OperatorResolve,
    OperatorRetry,
    StepCompleted,
    WorkflowCompleted,
    WorkflowFailed,
    encode_payload,
)
from mcp_saga.schemas.records import WorkflowState, idempotency_key

RESERVE = {
    "strategy": "compensation",
    "compensatingOperation": {
        "operationId": "release_inventory",
        "parameters": {"reservationId": "$response.body#/reservationId"},
    },
}
CHARGE = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "refund_payment", "parameters": {"transactionId": "$response.body#/tx"}},
}


def ev(payload, workflow: str = "order-1", n: list[int] = [0]) -> Event:  # noqa: B006 - a counter
    n[0] += 1
    return Event(id=f"{n[0]}-0", type=payload.TYPE, workflow=workflow, data=payload, raw=encode_payload(payload))


def step(name: str, server: str = "inventory", tool: str = "reserve_inventory", recovery=RESERVE, body=None):
    body = body if body is not None else {"reservationId": f"R-{name}", "tx": f"T-{name}"}
    return StepCompleted(step=name, server=server, tool=tool, result={"structuredContent": body}, recovery=recovery)


@pytest.fixture
def machine() -> Machine:
    coordinator = {"barrier_grace": 5, "watchdog_after": 10, "claim_idle_ms": 1000}
    return Machine(parse_config({"coordinator": coordinator, "worker": {"backoff_max": 5}}))


def fold(machine: Machine, view: WorkflowView, *payloads, now: float = 100.0) -> WorkflowView:
    for payload in payloads:
        machine.apply(view, ev(payload, view.workflow), now)
    return view


def new_view(workflow: str = "order-1") -> WorkflowView:
    return WorkflowView(workflow, WorkflowState(), {}, full=True)


def settle(machine: Machine, view: WorkflowView, now: float = 101.0) -> list[str]:
    """Let a perfect worker succeed every job, in the order the machine dispatches them.

    A job's routing slip runs after it, step after step, while each step's record is still queued
    under that dispatch (as `workers/job.py` checks).
    """
    order = []
    while view.jobs:
        job = view.jobs.pop(0)
        for one in (job, *job.then):
            comp = view.comps[one.step]
            if one is not job and (comp.status != "queued" or comp.dispatch != one.dispatch):
                break
            order.append(one.step)
            fold(machine, view, CompensationSucceeded(step=one.step, dispatch=one.dispatch), now=now)
    return order


def test_unwinds_in_reverse_completion_order_one_at_a_time(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), step("c"), WorkflowFailed(reason="ship failed"))
    assert view.state.status == "compensating"
    assert [j.step for j in view.jobs] == ["c"]  # one in flight
    assert settle(machine, view) == ["c", "b", "a"]
    assert view.state.status == "compensated"
    assert [c.status for c in view.comps.values()] == ["succeeded"] * 3


def test_parallel_dispatches_everything_at_once(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed(parallel=True))
    assert sorted(j.step for j in view.jobs) == ["a", "b"]


def test_job_carries_resolved_arguments_and_stable_key(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed())
    (job,) = view.jobs
    assert job.operation_id == "release_inventory"
    assert job.arguments == {"reservationId": "R-a"}
    assert job.server == "inventory"
    assert job.idempotency_key == idempotency_key("order-1", "a", "release_inventory")


def test_steps_without_recovery_are_skipped_and_unresolvable_are_unrecoverable(machine: Machine) -> None:
    view = fold(
        machine,
        new_view(),
        step("plain", recovery=None),
        step("broken", body={"other": 1}),
        step("good"),
        WorkflowFailed(),
    )
    assert view.comps["plain"].status == "skipped"
    broken = view.comps["broken"]
    assert broken.status == "unrecoverable"
    assert broken.arguments is None  # never partial arguments
    assert "reservationId" in (broken.reason or "")
    assert settle(machine, view) == ["good"]
    assert view.state.status == "needs-attention"  # an unrecoverable step is not "compensated"
    assert "broken" in view.state.attention


def test_duplicate_events_change_nothing_twice(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("a"), WorkflowFailed(), WorkflowFailed())
    assert view.state.steps == 1
    assert len(view.jobs) == 1
    job = view.jobs[0]
    fold(machine, view, CompensationSucceeded(step="a", dispatch=job.dispatch))
    version = view.state.version
    log_size = len(view.log)
    fold(machine, view, CompensationSucceeded(step="a", dispatch=job.dispatch))
    assert view.state.version == version and len(view.log) == log_size


def test_final_failure_halts_by_default(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed())
    job = view.jobs.pop()
    fold(machine, view, CompensationFailed(step="b", dispatch=job.dispatch, attempt=1, final=False, error="503"))
    assert view.comps["b"].status == "running"
    fold(machine, view, CompensationFailed(step="b", dispatch=job.dispatch, attempt=2, final=True, error="503"))
    assert view.comps["b"].status == "failed"
    assert view.state.status == "needs-attention"
    assert view.jobs == []  # "a" is not undone under a step that could not be undone
    assert view.comps["a"].status == "pending"


def test_continue_option_unwinds_past_a_failure(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed(on_failure="continue"))
    job = view.jobs.pop()
    fold(machine, view, CompensationFailed(step="b", dispatch=job.dispatch, final=True, error="gone"))
    assert [j.step for j in view.jobs] == ["a"]
    settle(machine, view)
    assert view.state.status == "needs-attention"
    assert view.comps["a"].status == "succeeded"


def test_operator_retry_and_resolve(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed())
    job = view.jobs.pop()
    fold(machine, view, CompensationFailed(step="b", dispatch=job.dispatch, final=True, error="x"))
    fold(machine, view, OperatorRetry(step="b", by="alice"))
    (retry,) = view.jobs
    assert retry.step == "b" and retry.dispatch == job.dispatch + 1
    assert retry.idempotency_key == job.idempotency_key
    view.jobs.clear()
    fold(machine, view, CompensationFailed(step="b", dispatch=retry.dispatch, final=True, error="x"))
    fold(machine, view, OperatorResolve(step="b", by="alice", note="refunded by hand"))
    assert view.comps["b"].status == "resolved"
    assert settle(machine, view) == ["a"]
    assert view.state.status == "compensated"
    assert any(e.type == "operator-resolve" and e.by == "alice" for e in view.log)


def test_approval_gate(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed())
    job = view.jobs.pop()
    fold(
        machine, view, CompensationRefused(step="a", dispatch=job.dispatch, status="awaiting-approval", reason="policy")
    )
    assert view.state.status == "needs-attention"
    fold(machine, view, OperatorApprove(step="a", by="bob"))
    (again,) = view.jobs
    assert again.approved and again.dispatch == job.dispatch + 1
    settle(machine, view)
    assert view.state.status == "compensated"


def test_a_superseded_dispatchs_success_settles_the_step_without_counting_its_attempt_again(
    machine: Machine,
) -> None:
    """Found by the state-machine test: dispatch 1's attempt 3 was refused (counted), an approval
    re-dispatched it, then a success naming that same attempt arrived; it was counted a second time.
    """
    view = fold(machine, new_view(), step("a"), WorkflowFailed())
    job = view.jobs.pop()
    refused = CompensationRefused(step="a", dispatch=job.dispatch, attempt=3, status="awaiting-approval", reason="p")
    fold(machine, view, refused, OperatorApprove(step="a", by="bob"))
    assert view.comps["a"].attempts == 1 and view.comps["a"].dispatch == job.dispatch + 1
    fold(machine, view, CompensationSucceeded(step="a", dispatch=job.dispatch, attempt=3))
    assert view.comps["a"].status == "succeeded" and view.comps["a"].attempts == 1
    assert view.state.status == "compensated"


def test_barrier_waits_for_announced_steps(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed(steps_completed=2))
    assert view.state.status == "failed" and view.jobs == []
    fold(machine, view, step("b"))
    assert view.state.status == "compensating"
    assert settle(machine, view) == ["b", "a"]


def test_barrier_grace_expiry_plans_anyway_and_flags(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed(steps_completed=3), now=100.0)
    assert machine.next_deadline(view) == 105.0
    machine.tick(view, 104.0)
    assert view.jobs == []
    machine.tick(view, 105.0)
    assert settle(machine, view) == ["a"]
    assert view.state.status == "needs-attention"
    assert "2 step(s)" in view.state.attention


def test_late_step_is_compensated_and_flagged(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed())
    settle(machine, view)
    assert view.state.status == "compensated"
    fold(machine, view, step("late"))
    assert view.comps["late"].late
    assert [j.step for j in view.jobs] == ["late"]
    assert any(e.type == "late-step" for e in view.log)
    settle(machine, view)
    assert view.state.status == "compensated"


def test_watchdog_redispatches_with_same_key(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), WorkflowFailed(), now=100.0)
    first = view.jobs.pop()
    machine.tick(view, 109.0)
    assert view.jobs == []
    machine.tick(view, 110.0)
    (second,) = view.jobs
    assert second.dispatch == first.dispatch + 1
    assert second.idempotency_key == first.idempotency_key
    assert any(e.type == "watchdog-redispatch" for e in view.log)
    # The superseded dispatch's late success still counts: the compensation happened.
    fold(machine, view, CompensationSucceeded(step="a", dispatch=first.dispatch), now=111.0)
    assert view.state.status == "compensated"


def test_nonsense_is_rejected(machine: Machine) -> None:
    with pytest.raises(Rejected, match="unknown workflow"):
        fold(machine, new_view(), CompensationSucceeded(step="a"))
    view = fold(machine, new_view(), step("a"), WorkflowCompleted())
    with pytest.raises(Rejected, match="after the workflow completed"):
        fold(machine, view, WorkflowFailed())
    with pytest.raises(Rejected, match="no compensation record"):
        fold(machine, fold(machine, new_view("w2"), step("a"), WorkflowFailed()), CompensationSucceeded(step="zz"))


def test_failure_before_any_step_ends_compensated_with_nothing_to_do(machine: Machine) -> None:
    view = fold(machine, new_view(), WorkflowFailed(reason="first call failed"))
    assert view.state.status == "compensated"
    assert view.outcomes[-1].type == "workflow-compensated"


def test_overlay_wins_over_server_declaration_and_is_noted() -> None:
    overlay = {
        "strategy": "compensation",
        "compensatingOperation": {"operationId": "cancel_reservation", "parameters": {"id": "$request.body#/sku"}},
    }
    machine = Machine(
        parse_config({"servers": {"inventory": {"url": "http://x/mcp", "recovery": {"reserve_inventory": overlay}}}})
    )
    s = step("a")
    s = StepCompleted(step="a", server=s.server, tool=s.tool, result=s.result, recovery=RESERVE, arguments={"sku": "X"})
    view = fold(machine, new_view(), s)
    comp = view.comps["a"]
    assert (comp.source, comp.operation_id, comp.arguments) == ("overlay", "cancel_reservation", {"id": "X"})
    assert any(e.type == "overlay-override" for e in view.log)


def test_a_late_step_waits_for_the_compensation_in_flight(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed())
    (first,) = view.jobs
    view.jobs.clear()
    fold(machine, view, step("late"))
    assert view.jobs == []  # "b" is still in flight: one at a time
    fold(machine, view, CompensationSucceeded(step="b", dispatch=first.dispatch))
    assert [j.step for j in view.jobs] == ["late"]  # the latest completion goes first
    assert settle(machine, view) == ["late", "a"]


def test_a_step_handled_after_completion_is_recorded_not_undone(machine: Machine) -> None:
    """Published before workflow-completed, handled after it (a coordinator died holding it)."""
    view = fold(machine, new_view(), step("a"), WorkflowCompleted(), step("b"))
    assert view.state.status == "completed" and view.state.steps == 2
    assert view.comps["b"].status == "skipped" and "completed" in (view.comps["b"].reason or "")
    assert view.jobs == [] and len(view.new_steps) == 2
    assert view.log[-1].type == "late-step"
    assert not any(o.type.startswith("workflow-") and o.type != "workflow-completed" for o in view.outcomes)


def test_watchdog_spares_a_leased_or_reporting_compensation_and_keeps_its_budget(machine: Machine) -> None:
    """Silent = no attempt report of the current dispatch for `watchdog_after` and no live lease."""
    view = fold(machine, new_view(), step("a"), WorkflowFailed(), now=100.0)
    assert [j.dispatch for j in view.jobs] == [1]
    view.jobs.clear()
    machine.tick(view, 110.0, leased={"a"})  # a call in flight holds the lease: not silent
    assert view.jobs == [] and machine.next_deadline(view) == 120.0
    failed = CompensationFailed(step="a", dispatch=1, attempt=1, final=False, retryable=True, error="timeout")
    fold(machine, view, failed, now=115.0)  # an attempt report pushes the deadline past RQ's backoff
    wait = machine.config.worker.retry_wait(0)  # the longest RQ may park the first retry
    assert view.comps["a"].retry_at == 115.0 + wait
    machine.tick(view, 125.0)
    assert view.jobs == [] and machine.next_deadline(view) == 125.0 + wait
    machine.tick(view, 125.0 + wait)  # silent now: dispatched again, with the attempt already used
    (second,) = view.jobs
    assert (second.dispatch, second.attempts_used) == (2, 1)
    # The superseded dispatch's late attempt report changes nothing.
    assert view.comps["a"].retry_at == 0.0
    fold(machine, view, CompensationFailed(step="a", dispatch=1, attempt=2, final=True, error="late"), now=130.0)
    assert view.comps["a"].status == "queued" and view.comps["a"].spent == 1


def test_a_silent_compensation_with_its_budget_used_fails_instead_of_running_again(machine: Machine) -> None:
    """Every attempt reported (by a worker that believed more were left), then silence: no more calls."""
    view = fold(machine, new_view(), step("a"), WorkflowFailed(), now=100.0)
    view.jobs.clear()
    attempts = machine.attempts
    for n in range(1, attempts + 1):
        report = CompensationFailed(step="a", dispatch=1, attempt=n, final=False, retryable=True, error="timeout")
        fold(machine, view, report, now=100.0 + n)
    machine.tick(view, 200.0)
    assert view.jobs == []
    assert view.comps["a"].status == "failed"
    assert view.state.status == "needs-attention"
    assert f"no report after attempt {attempts} of {attempts}" in view.state.attention


def test_barrier_grace_zero_announces_needs_attention_once() -> None:
    """Found on the way (issue 12): the outcome and the status entry were written twice."""
    machine = Machine(parse_config({"coordinator": {"barrier_grace": 0}}))
    view = fold(machine, new_view(), step("a", recovery=None), WorkflowFailed(steps_completed=2))
    assert view.state.status == "needs-attention"
    assert [o.type for o in view.outcomes] == ["workflow-needs-attention"]
    assert [e.type for e in view.log].count("status") == 1


def test_a_routing_slip_carries_the_rest_and_a_failure_takes_it_back(machine: Machine) -> None:
    """One job for the whole unwind; a step that fails in it hands the rest back to the coordinator."""
    view = fold(machine, new_view(), step("a"), step("b"), step("c"), WorkflowFailed(), now=100.0)
    (job,) = view.jobs
    assert (job.step, [m.step for m in job.then]) == ("c", ["b", "a"])
    assert {s: (c.status, c.via) for s, c in view.comps.items()} == {
        "c": ("queued", ""),
        "b": ("queued", job.job_id),
        "a": ("queued", job.job_id),
    }
    assert machine.jobs_in_flight(view) == [job]  # what a redelivered batch re-ensures: the same slip
    view.jobs.clear()
    fold(machine, view, CompensationSucceeded(step="c", dispatch=1), now=101.0)
    assert view.jobs == []  # the rest is on its way in the slip
    b = view.comps["b"]
    failed = CompensationFailed(step="b", dispatch=b.dispatch, attempt=1, final=False, retryable=True, error="x")
    fold(machine, view, failed)
    # b's retry is the coordinator's (no RQ retry behind a slip's step): dispatched again, with a
    # taken back and riding behind it in a new slip, as a job held for the backoff of a first retry.
    (again,) = view.jobs
    assert (again.step, again.dispatch, again.attempts_used, [m.step for m in again.then]) == ("b", 2, 1, ["a"])
    assert view.comps["a"].via == again.job_id and view.comps["a"].dispatch == 2
    worker = machine.config.worker
    assert 100.0 + worker.backoff(0, -1) <= again.not_before <= math.ceil(100.0 + worker.backoff(0, 1))
    assert again.not_before > 100.0 and [m.not_before for m in again.then] == [0.0]  # a rides in b's job
    # the watchdog counts silence from when the held job is due, not from its dispatch
    assert machine.silent_until(view.comps["b"]) == again.not_before + machine.settings.watchdog_after
    view.jobs.clear()
    machine.tick(view, again.not_before + 1)  # due, but not silent yet: nothing dispatched again
    assert view.jobs == []


def test_a_slip_step_retried_without_backoff_when_none_is_configured() -> None:
    machine = Machine(parse_config({"worker": {"backoff_base": 0}}))
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed(), now=100.0)
    view.jobs.clear()
    fold(machine, view, CompensationSucceeded(step="b", dispatch=1), now=101.0)
    failed = CompensationFailed(step="a", dispatch=1, attempt=1, final=False, retryable=True, error="x")
    fold(machine, view, failed, now=102.0)
    (again,) = view.jobs
    assert (again.step, again.dispatch, again.not_before) == ("a", 2, 0.0)


def test_a_silent_slip_is_taken_back_and_dispatched_again_in_order(machine: Machine) -> None:
    view = fold(machine, new_view(), step("a"), step("b"), WorkflowFailed(), now=100.0)
    assert [(j.step, [m.step for m in j.then]) for j in view.jobs] == [("b", ["a"])]
    view.jobs.clear()
    machine.tick(view, 200.0)  # the worker died holding the slip: nothing alive, nothing reported
    (again,) = view.jobs
    assert (again.step, again.dispatch, again.then) == ("b", 2, ())  # the head again, on its own
    assert (view.comps["a"].status, view.comps["a"].via) == ("pending", "")  # taken back, not re-dispatched
    fold(machine, view, CompensationSucceeded(step="b", dispatch=2), now=201.0)
    assert [j.step for j in view.jobs] == ["b", "a"]  # then a, in LIFO order
