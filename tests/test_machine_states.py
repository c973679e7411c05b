"""The per-workflow protocol, proven by a hypothesis rule-based state machine (issue 11).

Two simulated coordinators race through the real compare-and-set (the real Store and Lua
scripts, on fakeredis): each loads the workflow into its hand, folds any published entry into it
(duplicates, redeliveries and out-of-order claims included), commits, and applies its follow-up
later (so follow-ups of older transitions land late). A simulated worker reports on any job ever
dispatched, stale dispatches included; the watchdog ticks with leases alive or not; operators act.

Invariants, after every rule: at most one compensation in flight (LIFO mode); non-late steps
succeed in reverse stream order (while no operator changed the plan); once follow-ups are applied,
the workflow's index entry names its status and only it; no attempt is counted twice;
`compensated` only when every step is succeeded, skipped or resolved; a stale dispatch's failure
never changes a record. With intents (step-started, issue 14): a compensation is only ever
dispatched with arguments resolved from a real result (the step's own, or a recall's), never
guessed; a recall re-sends exactly the intent's arguments and forward key; a workflow is never
`compensated` while a step is in doubt.

Bounded for CI; `HYPOTHESIS_PROFILE=nightly` runs it much longer (see README, Testing).
"""

from __future__ import annotations

import os
from copy import deepcopy

import fakeredis
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from mcp_saga.coordinator.machine import Machine, Rejected, WorkflowView
from mcp_saga.coordinator.store import IndexItem, Store, index_item
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import (
    CompensationFailed,
    CompensationRefused,
    CompensationSucceeded,
    DeclarationFailed,
    DeclarationRead,
    Event,
    OperatorApprove,
    OperatorResolve,
    OperatorRetry,
    OperatorSkip,
    RecallFailed,
    RecallSucceeded,
    StepCompleted,
    StepStarted,
    WorkflowCompleted,
    WorkflowFailed,
    encode_payload,
)
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import IN_FLIGHT, CompensationJob, forward_key, idempotency_key

WF = "wf"
STEPS = "abcde"
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$response.body#/id"}},
}
PROFILES = {
    "ci": settings(max_examples=150, stateful_step_count=50, deadline=None, database=None),
    "nightly": settings(max_examples=3000, stateful_step_count=120, deadline=None, database=None),
}
COORDINATORS = st.sampled_from(["A", "B"])


class Protocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.r = fakeredis.FakeRedis()
        config = parse_config(
            {
                "coordinator": {"barrier_grace": 5, "watchdog_after": 10, "claim_idle_ms": 1000},
                "worker": {"attempts": 3, "backoff_max": 5},
                "servers": {"svc": {"url": "http://svc/mcp"}},
            }
        )
        self.machine = Machine(config)
        self.keys = Keys()
        self.store = Store(self.r, self.keys, config.coordinator)
        self.reader = Reader(self.r, self.keys)
        self.now = 1000.0
        self.stream: list[Event] = []
        self.hands: dict[str, WorkflowView | None] = {"A": None, "B": None}
        self.outbound: dict[str, list[tuple[list[IndexItem], list[WorkflowView]]]] = {"A": [], "B": []}
        self.jobs: list[CompensationJob] = []
        # A routing slip's step -> the one before it in its slip: a worker reports it only after
        # that one succeeded, and only while its record is still queued under that dispatch.
        self.after: dict[tuple[str, int], tuple[str, int]] = {}
        self.ok: set[tuple[str, int]] = set()
        self.reports: dict[str, set[tuple[int, int]]] = {}
        self.succeeded: list[tuple[str, str]] = []  # (event id, step) of non-late steps, in success order
        self.plan_changed = False
        self.cursor = {"A": 0, "B": 0}

    @initialize(steps=st.integers(0, 4), announced=st.booleans())
    def started(self, steps: int, announced: bool) -> None:
        """Most runs start mid-workflow, so that the unwind, not the prologue, gets the rules."""
        for name in STEPS[:steps]:
            self.step(name, False)
        if steps:
            self.failure(steps + 1 if announced else None)

    # Publishing ---------------------------------------------------------------------------

    def publish(self, payload: object) -> None:
        n = len(self.stream) + 1
        self.stream.append(
            Event(id=f"{n}-0", type=payload.TYPE, workflow=WF, data=payload, raw=encode_payload(payload))  # type: ignore[attr-defined]
        )

    @rule(name=st.sampled_from(STEPS), stripped=st.booleans())
    def step(self, name: str, stripped: bool) -> None:
        """`stripped`: published with `recovery: null` (a client library dropped it): the declaration is read live."""
        result = {"structuredContent": {"id": f"id-{name}"}}
        recovery = None if stripped else RECOVERY
        self.publish(StepCompleted(step=name, server="svc", tool="do", result=result, recovery=recovery))

    @rule(name=st.sampled_from(STEPS), idempotent=st.booleans(), stripped=st.booleans())
    def intent(self, name: str, idempotent: bool, stripped: bool) -> None:
        """A call announced before it is made; its step-completed (the `step` rule) may never come."""
        annotations = {"idempotentHint": True} if idempotent else None
        key = forward_key(WF, name)
        arguments = {"n": name}
        self.publish(
            StepStarted(
                step=name,
                server="svc",
                tool="do",
                forward_key=key,
                arguments=arguments,
                recovery=None if stripped else RECOVERY,
                annotations=annotations,
            )
        )

    @rule(announced=st.none() | st.integers(0, len(STEPS)))
    def failure(self, announced: int | None) -> None:
        self.publish(WorkflowFailed(reason="boom", steps_completed=announced))

    @precondition(lambda self: len(self.stream) > 3)
    @rule()
    def completion(self) -> None:
        self.publish(WorkflowCompleted())

    @precondition(lambda self: bool(self.jobs))
    @rule(
        pick=st.integers(0, 10_000),
        kind=st.sampled_from(["ok", "retry", "final", "refused"]),
        attempt=st.integers(1, 4),
    )
    def report(self, pick: int, kind: str, attempt: int) -> None:
        job = self.jobs[pick % len(self.jobs)]  # any dispatch ever made, stale ones too
        if (job.step, job.dispatch) in self.after:
            record = self.reader.records(WF)[1].get(job.step)
            if self.after[(job.step, job.dispatch)] not in self.ok or record is None:
                return
            if (record.status, record.dispatch) != ("queued", job.dispatch):
                return
        if kind == "ok":
            self.ok.add((job.step, job.dispatch))
        common = {"step": job.step, "dispatch": job.dispatch, "attempt": attempt}
        self.reports.setdefault(job.step, set()).add((job.dispatch, attempt))
        if job.kind == "declaration":  # "refused": the live listing declares no recovery for the tool
            if kind in ("ok", "refused"):
                self.publish(DeclarationRead(**common, recovery=RECOVERY if kind == "ok" else None, listed_at=self.now))
            else:
                self.publish(DeclarationFailed(**common, final=kind == "final", retryable=kind == "retry", error="x"))
            return
        if job.kind == "recall":
            if kind == "ok":
                self.publish(RecallSucceeded(**common, result={"structuredContent": {"id": f"id-{job.step}"}}))
            elif kind == "refused":
                self.publish(RecallSucceeded(**common, result={"isError": True, "content": []}))
            else:
                self.publish(RecallFailed(**common, final=kind == "final", retryable=kind == "retry", error="x"))
            return
        if kind == "ok":
            self.publish(CompensationSucceeded(**common))
        elif kind == "refused":
            self.publish(CompensationRefused(**common, status="awaiting-approval", reason="policy"))
        else:
            self.publish(CompensationFailed(**common, final=kind == "final", retryable=kind == "retry", error="x"))

    @rule(kind=st.sampled_from(["retry", "resolve", "skip", "approve"]), on=st.none() | st.sampled_from(STEPS))
    def operator(self, kind: str, on: str | None) -> None:
        cls = {"retry": OperatorRetry, "resolve": OperatorResolve, "skip": OperatorSkip, "approve": OperatorApprove}
        self.publish(cls[kind](step=on, by="op"))

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    # Coordinators ---------------------------------------------------------------------------

    @rule(c=COORDINATORS)
    def load(self, c: str) -> None:
        self.hands[c] = self.store.load({WF: (True, ())})[WF]

    @precondition(lambda self: bool(self.stream))
    @rule(c=COORDINATORS, pick=st.integers(0, 10_000))
    def fold(self, c: str, pick: int) -> None:
        view = self.hands[c]
        if view is None:
            return
        event = self.stream[pick % len(self.stream)]
        data = event.data
        stale = (
            isinstance(data, CompensationFailed | CompensationRefused | RecallFailed | DeclarationFailed)
            and data.step in view.comps
            and data.dispatch < view.comps[data.step].dispatch
        )
        before = deepcopy(view.comps.get(getattr(data, "step", "") or ""))
        try:
            self.machine.apply(view, event, self.now)
        except Rejected:
            return
        if stale:
            after = view.comps[data.step]  # type: ignore[union-attr]
            assert (after.status, after.attempts, after.last_error) == (
                before.status,  # type: ignore[union-attr]
                before.attempts,  # type: ignore[union-attr]
                before.last_error,  # type: ignore[union-attr]
            ), f"a stale dispatch's report changed {data.step}"  # type: ignore[union-attr]
        if isinstance(data, OperatorRetry | OperatorResolve | OperatorSkip | OperatorApprove):
            self.plan_changed = True

    @rule(c=COORDINATORS, count=st.integers(1, 4))
    def batch(self, c: str, count: int) -> None:
        """A whole batch in one go: load, fold the next entries this coordinator has not read, commit."""
        self.load(c)
        for _ in range(count):
            if self.cursor[c] < len(self.stream):
                self.fold(c, self.cursor[c])
                self.cursor[c] += 1
        self.commit(c)

    @rule(c=COORDINATORS, leased=st.sets(st.sampled_from(STEPS)), pending=st.booleans())
    def watchdog(self, c: str, leased: set[str], pending: bool) -> None:
        view = self.store.load({WF: (True, ())})[WF]
        if not view.state.version:
            return
        self.machine.tick(view, self.now, leased, hold_barrier=pending)
        self.hands[c] = view

    @rule(c=COORDINATORS, inline=st.booleans())
    def commit(self, c: str, inline: bool = False) -> None:
        """`inline`: the commit writes its index item and outcomes itself (one Redis), else it
        leaves them to a follow-up that may come late or overtake another (a cluster's outbox)."""
        view = self.hands[c]
        self.hands[c] = None
        if view is None or not view.state.version:
            return
        before = self.reader.records(WF)
        item = index_item(view, self.machine.next_deadline(view), True)
        if view.dirty and not self.store.commit([view], items=[item] if inline else None)[0]:
            return  # lost the race: the entries would be redelivered, and may be folded again
        for job in view.jobs:
            self.jobs.append(job)
            prev = job
            for member in job.then:
                self.after[(member.step, member.dispatch)] = (prev.step, prev.dispatch)
                self.jobs.append(member)
                prev = member
        old = before[1] if before else {}
        for comp in sorted(view.comps.values(), key=lambda c: c.updated_at):
            if comp.status == "succeeded" and not comp.late and old.get(comp.step, comp).status != "succeeded":
                self.succeeded.append((comp.event_id, comp.step))
        if not view.indexed:
            self.outbound[c].append(([item], [view]))
        elif view.outbox:  # an outbox the view loaded (a crashed follow-up's): still written out after
            self.outbound[c].append(([], [view]))

    @precondition(lambda self: any(self.outbound.values()))
    @rule(c=COORDINATORS, late=st.booleans())
    def follow_up(self, c: str, late: bool) -> None:
        if not self.outbound[c]:
            return
        items, views = self.outbound[c].pop(-1 if late else 0)  # a late one may overtake an earlier one
        self.store.follow_up(items, views, [])
        self.store.settle(views, [])

    # Invariants ------------------------------------------------------------------------------

    @invariant()
    def one_in_flight(self) -> None:
        found = self.reader.records(WF)
        if found and not found[0].parallel:
            flying = [c for c in found[1].values() if c.status in IN_FLIGHT]
            assert sum(not c.via for c in flying) <= 1  # one job; a routing slip rides behind it
            assert len({c.via for c in flying if c.via}) <= 1

    @invariant()
    def lifo(self) -> None:
        if self.plan_changed:
            return
        order = [_stream_order(event_id) for event_id, _ in self.succeeded]
        assert order == sorted(order, reverse=True), f"undone out of LIFO order: {self.succeeded}"

    @invariant()
    def index_names_the_status(self) -> None:
        if any(self.outbound.values()):
            return
        found = self.reader.records(WF)
        if found:
            where = [s for s in STATUSES if self.r.zscore(self.keys.index(s), WF) is not None]
            assert where == [found[0].status], (where, found[0].status)

    @invariant()
    def attempts_counted_once(self) -> None:
        found = self.reader.records(WF)
        for comp in (found[1] if found else {}).values():
            assert comp.attempts <= len(self.reports.get(comp.step, ())), comp

    @invariant()
    def never_guessed(self) -> None:
        for job in self.jobs:
            if job.kind == "compensation":
                assert job.arguments == {"id": f"id-{job.step}"}, job
            elif job.kind == "declaration":  # calls nothing: lists the server for the step's own tool
                assert job.operation_id == "do" and job.idempotency_key == idempotency_key(WF, job.step, "tools/list")
            else:
                assert (job.operation_id, job.arguments) == ("do", {"n": job.step}), job
                assert job.idempotency_key == forward_key(WF, job.step), job

    @invariant()
    def compensated_means_undone(self) -> None:
        found = self.reader.records(WF)
        if found and found[0].status == "compensated":
            assert all(c.status in ("succeeded", "skipped", "resolved") for c in found[1].values()), found[1]


def _stream_order(event_id: str) -> tuple[int, int]:
    ms, _, n = event_id.partition("-")
    return int(ms), int(n)


TestProtocol = pytest.mark.timeout(900)(Protocol.TestCase)  # 150 runs take 10 s on a quiet box, minutes on a loaded one
TestProtocol.settings = settings(
    PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")], suppress_health_check=[HealthCheck.too_slow]
)
