"""The per-workflow state machine: events in, a set of writes and jobs out. Pure: no Redis here.

`WorkflowView` is what the store loaded for one workflow; `apply` folds one event into it and
records what must be written (state fields, new or changed compensation records, steps to push,
timeline entries), what must be announced (outcomes) and which jobs must be dispatched. The
store then commits all of it with one compare-and-set Lua script, so several coordinators can
handle events of the same workflow without ever interleaving two transitions.

Every transition is idempotent under redelivery: a step id already recorded, a failure already
known, a report already counted change nothing.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
from mcp_saga.coordinator.planner import no_live_declaration, plan_in_doubt, plan_step
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import (
    TEXT_MAX,
    CompensationFailed,
    CompensationRefused,
    CompensationSucceeded,
    DeclarationFailed,
    DeclarationRead,
    Event,
    OperatorCommand,
    RecallFailed,
    RecallSucceeded,
    Report,
    StepCompleted,
    StepStarted,
    WorkflowCompleted,
    WorkflowFailed,
    cut_text,
    encode_payload,
    field_repair,
    stream_id,
)
from mcp_saga.schemas.operators import operator_refusal
from mcp_saga.schemas.records import (
    IN_FLIGHT,
    OPEN,
    SETTLED,
    UNWINDING,
    Compensation,
    CompensationJob,
    WorkflowState,
    job_id_for,
)
from mcp_saga.schemas.results import result_text
from mcp_saga.schemas.timeline import Outcome, TimelineEntry


def timeline_entry(kind: str, now: float, step: str | None = None, **detail: Any) -> TimelineEntry:
    """One entry of `saga:{wf}:log`; `detail` names fields of `TimelineEntry`."""
    return TimelineEntry(type=kind, at=now, step=step, **detail)


def _repairs(repairs: tuple[str, ...]) -> str:
    """What decoding cut or left out of an event, for its timeline note."""
    return cut_text("; ".join(repairs), TEXT_MAX)


class Rejected(Exception):
    """An event that is well-formed but makes no sense for this workflow: dead-letter it."""


@dataclass
class WorkflowView:
    workflow: str
    state: WorkflowState
    comps: dict[str, Compensation]
    # Whether `comps` holds every record (else only those the batch's step events named).
    full: bool
    new_steps: list[bytes] = field(default_factory=list)
    # Stack entries replaced in place (position -> entry): a started step settled by its result.
    set_steps: dict[int, bytes] = field(default_factory=dict)
    changed: dict[str, Compensation] = field(default_factory=dict)
    log: list[TimelineEntry] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    jobs: list[CompensationJob] = field(default_factory=list)
    # Outcomes committed into the workflow's outbox and not yet written to `saga:outcomes` (JSON
    # items; the store fills and empties this, the machine never reads it).
    outbox: list[bytes | str] = field(default_factory=list)
    # Whether its commit wrote its index item and outcomes too (one Redis: Store.commit's `items`).
    indexed: bool = False
    loaded_version: int = 0
    loaded_status: str | None = None
    # Bumped by every recorded change, so a transition can tell whether an event changed anything.
    changes: int = 0

    def __post_init__(self) -> None:
        self.loaded_version = self.state.version
        self.loaded_status = self.state.status if self.state.version else None

    @property
    def dirty(self) -> bool:
        return bool(
            self.new_steps or self.set_steps or self.changed or self.log or self.state.version != self.loaded_version
        )

    def note(self, kind: str, now: float, step: str | None = None, **detail: object) -> None:
        self.log.append(timeline_entry(kind, now, step, **detail))
        self.changes += 1

    def put(self, comp: Compensation, now: float) -> None:
        comp.updated_at = now
        self.comps[comp.step] = comp
        self.changed[comp.step] = comp
        self.changes += 1


def completion_order(comp: Compensation) -> tuple[int, int, int]:
    """Where the step's event sits in the stream (XADD order is completion order), then arrival."""
    try:
        return (*stream_id(comp.event_id), comp.seq)
    except ValueError:  # a record written before it carried its event's id
        return 0, 0, comp.seq


FAILED_CALL = "its call answered with an error (isError): nothing to undo"


def completions(view: WorkflowView) -> int:
    """Steps the orchestrator saw complete among those recorded: what `stepsCompleted` counts (not an
    intent still open, nor one its call's error answer settled: either could make the barrier let go
    while a completed step is still on its way, and that step would then be undone out of order)."""
    return view.state.steps - sum(1 for c in view.comps.values() if c.open_intent or c.failed_call)


class Machine:
    def __init__(self, config: Config, prefix: str = "saga") -> None:
        self.config = config
        self.settings = config.coordinator
        self.prefix = prefix

    @staticmethod
    def needs_full(events: list[Event], state: WorkflowState | None = None) -> bool:
        """Only step events of a running (or new) workflow can be folded without every record loaded."""
        if state is not None and state.version and state.status != "running":
            return True
        return any(not isinstance(e.data, StepCompleted | WorkflowCompleted) for e in events)

    def apply(self, view: WorkflowView, event: Event, now: float) -> None:
        """Fold one event into the view; raises Rejected for an event to dead-letter."""
        data = event.data
        before = view.state.status if view.state.version else None
        snapshot = (view.changes, msgspec.structs.asdict(view.state))
        if not view.state.version:
            if isinstance(data, Report | OperatorCommand):
                raise Rejected(f"{event.type} for unknown workflow {view.workflow!r}")
            view.state = WorkflowState(status="running", created_at=now)
        if event.repairs and not isinstance(data, StepCompleted):  # a step's plan notes its own
            view.note(
                "event-repaired", now, getattr(data, "step", None), event=event.type, detail=_repairs(event.repairs)
            )
        match data:
            case StepCompleted():
                self._step(view, event, data, now)
            case StepStarted():
                self._started(view, event, data, now)
            case WorkflowFailed():
                self._failed(view, data, now)
            case WorkflowCompleted():
                self._completed(view, now, event.id)
            case Report():
                self._report(view, data, now)
            case OperatorCommand():
                self._operator(view, event.type, data, now)
        self.advance(view, now)
        if before is None or snapshot != (view.changes, msgspec.structs.asdict(view.state)):
            self._touch(view, before, now)

    def tick(
        self,
        view: WorkflowView,
        now: float,
        leased: frozenset[str] | set[str] = frozenset(),
        *,
        hold_barrier: bool = False,
    ) -> None:
        """The watchdog's look at a workflow: an expired barrier, a compensation gone silent.

        `leased` names the steps that showed a sign of life the machine cannot see in the records:
        their lease key exists (a worker holds it while a call is in flight) or their job still
        waits in the queue for a free worker. A compensation is silent when, for `watchdog_after`
        seconds, no report of its current dispatch arrived (nor was a retry of it due) and it shows
        no such sign; only a silent one is dispatched again.
        `hold_barrier`: an entry of this workflow is still pending in the consumer group, so an
        announced step may be on its way; the barrier does not expire yet.
        """
        state = view.state
        before, changes = state.status, view.changes
        if self.barrier_due(view, now) and not hold_barrier:
            self._expire_barrier(view, now)
        if self.idle_due(view, now):
            self._abandoned(view, now)
        for comp in list(view.comps.values()):
            if comp.status not in IN_FLIGHT or now < self.silent_until(comp):
                continue
            if comp.step in leased:  # a call in flight: not silent, look again later
                comp.heard_at = now
                view.put(comp, now)
                continue
            if comp.spent >= self.attempts:
                # Every attempt was used and the last one never reported (its worker died after
                # the call): dispatching again would exceed the budget the operator configured.
                comp.status = "failed"
                comp.last_error = f"no report after attempt {comp.spent} of {self.attempts}" + (
                    f"; last error: {comp.last_error}" if comp.last_error else ""
                )
                view.put(comp, now)
                view.note("compensation-failed", now, comp.step, error=comp.last_error, dispatch=comp.dispatch)
                self._outcome(view, "compensation-failed", now, comp.step, "failed", comp.last_error)
                continue
            if comp.via:  # behind a slip whose worker went silent: `advance` decides it again, in order
                comp.status, comp.via = "pending", ""
                view.put(comp, now)
                view.note("watchdog-redispatch", now, comp.step, detail="its routing slip went silent; taken back")
                continue
            self._revoke(view, comp, now)
            view.note(
                "watchdog-redispatch",
                now,
                comp.step,
                detail=f"no report and no lease for {now - max(comp.queued_at, comp.heard_at, comp.retry_at):.0f}s "
                f"in dispatch {comp.dispatch} ({comp.spent} of {self.attempts} attempts used)",
                key=comp.idempotency_key,
            )
            self._dispatch(view, comp, now)
        self.advance(view, now)
        if view.changes != changes or view.state.status != before:
            self._touch(view, before, now)

    @staticmethod
    def barrier_due(view: WorkflowView, now: float) -> bool:
        state = view.state
        return state.status == "failed" and bool(state.barrier_deadline) and now >= state.barrier_deadline

    def idle_due(self, view: WorkflowView, now: float) -> bool:
        """A running workflow with a call started and never settled, and no event for `in_doubt_after`."""
        state = view.state
        return (
            state.status == "running"
            and now >= state.updated_at + self.settings.in_doubt_after
            and any(c.status == "started" for c in view.comps.values())
        )

    @property
    def attempts(self) -> int:
        return self.config.worker.attempts

    def silent_until(self, comp: Compensation) -> float:
        """When an in-flight compensation counts as silent unless its lease is alive."""
        return max(comp.queued_at, comp.heard_at, comp.retry_at) + self.settings.watchdog_after

    def due_steps(self, view: WorkflowView, now: float) -> list[str]:
        """Steps whose silence the watchdog must confirm (their lease checked) before `tick`."""
        return [c.step for c in view.comps.values() if c.status in IN_FLIGHT and now >= self.silent_until(c)]

    def next_deadline(self, view: WorkflowView) -> float | None:
        """When the watchdog must look at this workflow again (None: nothing to watch)."""
        state = view.state
        if state.status == "failed" and state.barrier_deadline:
            return state.barrier_deadline
        if state.status == "running":
            started = any(c.status == "started" for c in view.comps.values())
            return state.updated_at + self.settings.in_doubt_after if started else None
        silent = [self.silent_until(c) for c in view.comps.values() if c.status in IN_FLIGHT]
        return min(silent) if silent else None

    # Transitions -------------------------------------------------------------------------

    def _step(self, view: WorkflowView, event: Event, data: StepCompleted, now: float) -> None:
        existing = view.comps.get(data.step)
        if existing is not None:
            if existing.open_intent:  # the result of a call whose intent is recorded
                self._settle(view, event, data, existing, now)
            return  # else a redelivery, or the orchestrator published twice
        state = view.state
        if state.status == "completed":
            self._step_after_completion(view, event, data, now)
            return
        late = state.status in UNWINDING
        comp, entries = self.plan_step(view.workflow, data, state.steps, late, now, event.id, event.repairs)
        view.put(comp, now)
        view.new_steps.append(event.raw)
        state.steps += 1
        view.log += entries
        if late:  # it goes first: what a routing slip still carries waits behind it
            for other in view.comps.values():
                if other.status == "queued" and other.via:
                    other.status, other.via = "pending", ""
                    view.put(other, now)
        if late and state.status in ("compensated", "needs-attention"):
            state.status = "compensating"
        if state.status == "failed" and completions(view) >= state.expected_steps:
            self._unwind(view, now)

    def plan_started(
        self, workflow: str, data: StepStarted, seq: int, now: float, event_id: str = "", repairs: tuple[str, ...] = ()
    ) -> tuple[Compensation, list[TimelineEntry]]:
        """An intent's record and its timeline entries (also for the fast path, which records without a read)."""
        overlay = self.config.overlay(data.server, data.tool)
        idempotent = self.idempotent(data.server, data.tool, data.annotations)
        cut = field_repair(repairs, "arguments")
        registered = data.server in self.config.servers
        comp = plan_in_doubt(
            workflow, data, seq, overlay, idempotent, now, self.config.policy, cut, registered
        ).compensation
        comp.event_id = event_id
        entries = []
        if repairs:
            entries.append(
                timeline_entry("event-repaired", now, data.step, event=StepStarted.TYPE, detail=_repairs(repairs))
            )
        return comp, entries

    def _started(self, view: WorkflowView, event: Event, data: StepStarted, now: float) -> None:
        """Record the intent at its place on the stack, with the plan for the case it is never settled."""
        if data.step in view.comps:
            return  # a redelivery, or its step-completed was handled first (a claim reordered them)
        state = view.state
        comp, entries = self.plan_started(view.workflow, data, state.steps, now, event.id, event.repairs)
        view.log += entries
        view.put(comp, now)
        view.new_steps.append(event.raw)
        state.steps += 1
        if state.status == "completed":
            comp.status, comp.reason = "skipped", "started after the workflow completed, which is never undone"
            view.note("late-step", now, data.step, tool=data.tool, plan=comp.status, reason=comp.reason)
        elif state.status in UNWINDING:  # an intent handled after the failure: nothing will settle it in time
            comp.late = True
            self._doubt(view, comp, now)
            if state.status in ("compensated", "needs-attention"):
                state.status = "compensating"

    def idempotent(self, server: str, tool: str, annotations: dict | None) -> bool:
        """Whether a tool is idempotent under its forward key: its own annotation, or the operator says so."""
        return (annotations or {}).get("idempotentHint") is True or self.config.declared_idempotent(server, tool)

    def _doubt(self, view: WorkflowView, comp: Compensation, now: float) -> None:
        """An intent the unwind found open: it takes the plan made for this case when it was recorded."""
        comp.in_doubt = True
        comp.status = comp.if_in_doubt or "in-doubt"
        view.put(comp, now)
        view.note(
            "step-in-doubt", now, comp.step, tool=comp.tool, plan=comp.status, reason=comp.reason, key=comp.forward_key
        )

    def _settle(self, view: WorkflowView, event: Event, data: StepCompleted, intent: Compensation, now: float) -> None:
        """A step-completed for a recorded intent: plan from its result, at the intent's place on the stack.

        Once the step is being undone with the request's arguments, has been settled by a recall,
        or an operator has judged it, the result changes nothing: it is noted, not planned again.
        """
        if (data.server, data.tool) != (intent.server, intent.tool):
            raise Rejected(
                f"step-completed for step {data.step!r} names {data.server}:{data.tool}, "
                f"but its step-started named {intent.server}:{intent.tool}"
            )
        state = view.state
        if data.result.get("isError") is True:  # the call answered with an error: nothing was done
            intent.status, intent.open_intent, intent.kind, intent.failed_call = "skipped", False, "compensation", True
            intent.reason = FAILED_CALL
            view.put(intent, now)
            view.set_steps[intent.seq] = event.raw
            if intent.in_doubt:
                view.note("step-settled", now, data.step, plan=intent.status, reason=intent.reason)
            if state.status == "failed" and completions(view) >= state.expected_steps:
                self._unwind(view, now)
            return
        # An in-doubt step judged unrecoverable had nothing done about it: its result may make it undoable.
        replannable = (
            intent.status in OPEN
            or (intent.in_doubt and intent.status == "unrecoverable")
            or (intent.status == "pending" if intent.kind == "compensation" else intent.status not in SETTLED)
        )
        if not replannable:
            intent.open_intent = False
            view.put(intent, now)
            view.note(
                "step-settled-late",
                now,
                data.step,
                detail=f"its step-completed arrived when the step was already {intent.status}; left as it is",
            )
        else:
            late = state.status in UNWINDING
            comp, entries = self.plan_step(view.workflow, data, intent.seq, late, now, intent.event_id, event.repairs)
            comp.forward_key, comp.in_doubt, comp.dispatch = intent.forward_key, intent.in_doubt, intent.dispatch
            if state.status == "completed":  # as for a step recorded after the completion (_step_after_completion)
                comp.status, comp.reason = "skipped", "settled after the workflow completed: nothing to undo"
            view.put(comp, now)
            view.set_steps[intent.seq] = event.raw
            view.log += entries
            if intent.in_doubt:
                view.note("step-settled", now, data.step, plan=comp.status, detail="planned from its result")
            if late and state.status in ("compensated", "needs-attention"):
                state.status = "compensating"
        if state.status == "failed" and completions(view) >= state.expected_steps:
            self._unwind(view, now)

    def _abandoned(self, view: WorkflowView, now: float) -> None:
        """No event for `in_doubt_after` while a call was open: the agent is presumed gone; unwind."""
        names = ", ".join(sorted(c.step for c in view.comps.values() if c.status == "started"))[:500]
        reason = (
            f"no event for {self.settings.in_doubt_after:g}s while step(s) {names} had started and not "
            "settled: the agent is presumed gone"
        )
        self._failed(view, WorkflowFailed(reason=reason), now)

    def _step_after_completion(self, view: WorkflowView, event: Event, data: StepCompleted, now: float) -> None:
        """A step published before workflow-completed but handled after it (a coordinator died holding
        it): it belongs in the workflow's history, and a completed workflow has nothing to undo."""
        comp, _ = self.plan_step(view.workflow, data, view.state.steps, True, now, event.id)
        comp.status, comp.reason = "skipped", "recorded after the workflow completed: nothing to undo"
        view.put(comp, now)
        view.new_steps.append(event.raw)
        view.state.steps += 1
        view.note("late-step", now, data.step, tool=data.tool, plan=comp.status, reason=comp.reason)

    def plan_step(
        self,
        workflow: str,
        data: StepCompleted,
        seq: int,
        late: bool,
        now: float,
        event_id: str = "",
        repairs: tuple[str, ...] = (),
        live: bool = False,
    ) -> tuple[Compensation, list[TimelineEntry]]:
        """A step's compensation plan and the timeline entries that record it (also for the fast path).

        `live`: `data.recovery` is the server's live declaration, read by a worker (a step without
        one is then skipped); else a step with no recovery from a registered server awaits that read.
        """
        registered = None if live else data.server in self.config.servers
        overlay = self.config.overlay(data.server, data.tool)
        plan = plan_step(workflow, data, seq, overlay, now, self.config.policy, registered)
        comp = plan.compensation
        comp.late = late
        comp.event_id = event_id
        if data.result.get("isError") is True:  # the settle of a failed call whose intent comes later (a claim)
            comp.status, comp.reason, comp.failed_call = "skipped", FAILED_CALL, True
        # The step stack already records every step; the timeline records the ones that need a
        # word: late, not compensable (skipped, unrecoverable, and why), or planned from an overlay.
        entries = []
        if late or comp.status != "pending" or comp.source == "overlay" or comp.kind == "declaration":
            entries.append(
                timeline_entry(
                    "late-step" if late else "step-planned",
                    now,
                    data.step,
                    tool=data.tool,
                    plan=comp.status,
                    operation=comp.operation_id,
                    source=comp.source,
                    reason=comp.reason,
                )
            )
        entries += [timeline_entry("overlay-override", now, data.step, detail=note) for note in plan.notes]
        if repairs:
            entries.append(
                timeline_entry("event-repaired", now, data.step, event=StepCompleted.TYPE, detail=_repairs(repairs))
            )
        return comp, entries

    def _failed(self, view: WorkflowView, data: WorkflowFailed, now: float) -> None:
        state = view.state
        if state.status in UNWINDING:
            return
        if state.status == "completed":
            raise Rejected("workflow-failed after the workflow completed")
        state.reason = data.reason
        state.failed_tool = (data.failed_step.tool or "") if data.failed_step else ""
        state.parallel = self.settings.parallel if data.parallel is None else data.parallel
        state.on_failure = data.on_failure or self.settings.on_failure
        state.expected_steps = data.steps_completed or 0
        error = data.failed_step.error if data.failed_step else None
        view.note("workflow-failed", now, reason=data.reason, tool=state.failed_tool, error=error)
        if state.expected_steps > completions(view):
            state.status = "failed"
            state.barrier_deadline = now + self.settings.barrier_grace
            view.note(
                "barrier-wait",
                now,
                detail=f"waiting up to {self.settings.barrier_grace:g}s for "
                f"{state.expected_steps - completions(view)} more step(s)",
            )
            if self.settings.barrier_grace == 0:
                self._expire_barrier(view, now)
        else:
            self._unwind(view, now)

    def _expire_barrier(self, view: WorkflowView, now: float) -> None:
        state = view.state
        state.barrier_expired = True
        view.note(
            "barrier-expired",
            now,
            detail=f"{state.expected_steps - completions(view)} announced step(s) never arrived; unwinding the rest",
        )
        self._unwind(view, now)

    def _unwind(self, view: WorkflowView, now: float) -> None:
        for comp in sorted(view.comps.values(), key=completion_order):
            if comp.status == "started":
                self._doubt(view, comp, now)
        view.state.status = "compensating"
        view.state.barrier_deadline = 0.0

    def _completed(self, view: WorkflowView, now: float, entry: str = "") -> None:
        state = view.state
        if state.status == "completed":
            return
        if state.status != "running":
            raise Rejected(f"workflow-completed for a workflow that is {state.status}")
        state.status = "completed"
        view.note("workflow-completed", now, entry=entry or None)

    def _report(self, view: WorkflowView, data: Report, now: float) -> None:
        comp = view.comps.get(data.step)
        if comp is None:
            raise Rejected(f"report for step {data.step!r}, which has no compensation record")
        if not 1 <= data.dispatch <= comp.dispatch:
            # No worker was ever handed that dispatch: believing it would mark a step undone (or
            # failed) that nobody tried to undo.
            raise Rejected(
                f"report for step {data.step!r} names dispatch {data.dispatch}, but {comp.dispatch} were made"
            )
        detail = dict(
            server=data.server,
            operation=data.operation_id,
            key=data.idempotency_key,
            digest=data.arguments_digest,
            attempt=data.attempt,
            dispatch=data.dispatch,
            duration_ms=data.duration_ms,
            worker=data.worker,
        )
        if comp.status in SETTLED:
            return  # a redelivery, or a superseded dispatch reporting late: the first word stands
        if isinstance(data, RecallSucceeded | RecallFailed):
            self._recalled(view, comp, data, detail, now)
            return
        if isinstance(data, DeclarationRead | DeclarationFailed):
            self._declaration(view, comp, data, detail, now)
            return
        if isinstance(data, CompensationSucceeded):
            comp.status = "succeeded"
            _count_attempt(comp, data)
            comp.last_error = None
            view.put(comp, now)
            view.note("compensation-succeeded", now, data.step, **detail)
            self._outcome(view, "compensation-succeeded", now, comp.step)
            return
        # Failures and refusals only count for the current dispatch, once per attempt.
        if not _new_attempt(comp, data):
            return
        self._revoke(view, comp, now)  # the slip's worker stopped here: what it carried is decided anew
        comp.attempt = data.attempt
        comp.attempts += 1
        comp.spent += 1
        comp.heard_at = now  # an attempt report: the dispatch is alive, silence counts from here
        if isinstance(data, CompensationRefused):
            comp.status, comp.reason = data.status, data.reason
            if comp.kind == "recall" and data.status == "unrecoverable":
                # A refused recall learned nothing: the outcome is still unknown, and an in-doubt step halts.
                comp.status = "in-doubt"
                comp.reason = cut_text(f"in doubt, and its recall was refused: {data.reason}", TEXT_MAX)
            view.note("compensation-refused", now, data.step, status=data.status, reason=data.reason, **detail)
            self._outcome(view, "compensation-refused", now, comp.step, comp.status, comp.reason or "")
        elif isinstance(data, CompensationFailed):
            comp.last_error = data.error
            if data.final:
                comp.status = "failed"
                self._outcome(view, "compensation-failed", now, comp.step, "failed", data.error)
            elif comp.via:  # no RQ retry behind a step of a slip: `advance` dispatches it again,
                # due after the backoff any attempt waits (the job is held until then, see _dispatch)
                comp.status, comp.via = "pending", ""
                # (a whole second: what RQ's scheduler keeps, so silence counts from when it runs)
                comp.retry_at = math.ceil(now + self.config.worker.backoff(comp.spent - 1, _spread(comp)))
            else:
                comp.status = "running"
                # RQ parks the next attempt for its backoff: no report and no lease until then.
                comp.retry_at = now + self.config.worker.retry_wait(comp.spent - 1)
            view.note(
                "compensation-failed" if data.final else "compensation-attempt-failed",
                now,
                data.step,
                error=data.error,
                retryable=data.retryable,
                **detail,
            )
        view.put(comp, now)

    def _recalled(
        self, view: WorkflowView, comp: Compensation, data: RecallSucceeded | RecallFailed, detail: dict, now: float
    ) -> None:
        """A worker's word on re-calling an in-doubt step's tool: its result settles the step."""
        if comp.kind != "recall":
            return  # its step-completed arrived first and settled it
        if isinstance(data, RecallSucceeded):
            if data.result.get("isError"):
                comp.status = "skipped"
                _count_attempt(comp, data)
                text = result_text(data.result, " ") or "no text"
                comp.reason = cut_text(
                    f"in doubt, and calling it again with its forward key returned an error: nothing to undo ({text})",
                    TEXT_MAX,
                )
                view.put(comp, now)
                view.note("recall-succeeded", now, comp.step, plan=comp.status, reason=comp.reason, **detail)
                return
            step = StepCompleted(
                step=comp.step,
                server=comp.server,
                tool=comp.tool,
                result=data.result,
                arguments=comp.arguments or {},
                recovery=comp.recovery,
            )
            new, entries = self.plan_step(view.workflow, step, comp.seq, comp.late, now, comp.event_id)
            new.forward_key, new.in_doubt, new.dispatch = comp.forward_key, True, comp.dispatch
            new.open_intent = comp.open_intent
            view.put(new, now)
            view.set_steps[comp.seq] = encode_payload(step)
            view.log += entries
            view.note("recall-succeeded", now, comp.step, plan=new.status, reason=new.reason, **detail)
            return
        self._call_failed(view, comp, data, "recall", detail, now)

    def _call_failed(
        self,
        view: WorkflowView,
        comp: Compensation,
        data: RecallFailed | DeclarationFailed,
        what: str,
        detail: dict,
        now: float,
    ) -> None:
        """A worker's failed attempt at a call that is not the undo itself (`what`: a recall, or the
        read of a live declaration): counted like an attempt at the undo, and final, it halts the unwind."""
        if not _new_attempt(comp, data):
            return
        comp.attempt, comp.attempts, comp.spent, comp.heard_at = data.attempt, comp.attempts + 1, comp.spent + 1, now
        comp.last_error = cut_text(f"{what}: {data.error}", TEXT_MAX)
        comp.status = "failed" if data.final else "running"
        if data.final:
            self._outcome(view, "compensation-failed", now, comp.step, "failed", comp.last_error)
        view.put(comp, now)
        view.note(
            f"{what}-failed" if data.final else f"{what}-attempt-failed",
            now,
            comp.step,
            error=data.error,
            retryable=data.retryable,
            **detail,
        )

    def _declaration(
        self,
        view: WorkflowView,
        comp: Compensation,
        data: DeclarationRead | DeclarationFailed,
        detail: dict,
        now: float,
    ) -> None:
        """A worker's read of the server's live declaration, for a step whose event carried none: the
        step is planned from it as if its event had carried it (an in-doubt intent, as in doubt)."""
        if comp.kind != "declaration":
            return  # its step-completed (or a recall) planned it meanwhile
        if isinstance(data, DeclarationFailed):
            self._call_failed(view, comp, data, "declaration", detail, now)
            return
        if data.dispatch != comp.dispatch:
            return  # a superseded dispatch: the current one's read decides
        at = _iso(data.listed_at or now)
        if comp.open_intent:
            intent = StepStarted(
                step=comp.step,
                server=comp.server,
                tool=comp.tool,
                forward_key=comp.forward_key or "",
                arguments=comp.arguments or {},
                recovery=data.recovery,
                annotations=data.annotations,
            )
            idempotent = self.idempotent(comp.server, comp.tool, data.annotations)
            overlay = self.config.overlay(comp.server, comp.tool)
            new = plan_in_doubt(
                view.workflow, intent, comp.seq, overlay, idempotent, now, self.config.policy
            ).compensation
            new.status = new.if_in_doubt or "in-doubt"  # a recall it plans binds its result with this declaration
            entries: list[TimelineEntry] = []
        else:
            step = StepCompleted(
                step=comp.step,
                server=comp.server,
                tool=comp.tool,
                result=comp.result or {},
                arguments=comp.arguments or {},
                recovery=data.recovery,
            )
            new, entries = self.plan_step(view.workflow, step, comp.seq, comp.late, now, comp.event_id, live=True)
        if data.recovery is None and new.status == "skipped":
            new.reason = no_live_declaration(data.listed, at)
        new.late, new.event_id, new.dispatch, new.in_doubt = comp.late, comp.event_id, comp.dispatch, comp.in_doubt
        new.forward_key, new.open_intent = comp.forward_key, comp.open_intent
        # The read is this record's last attempt; the plan it makes starts a budget of its own.
        new.attempts = comp.attempts + (1 if _new_attempt(comp, data) else 0)
        view.put(new, now)
        view.log += entries
        view.note(
            "declaration-read",
            now,
            comp.step,
            plan=new.status,
            operation=new.operation_id,
            source=new.source,
            reason=new.reason,
            detail=f"planned from {comp.server}'s live declaration of {comp.tool}, read at {at}",
            **{k: v for k, v in detail.items() if k != "operation"},
        )

    def _operator(self, view: WorkflowView, kind: str, data: OperatorCommand, now: float) -> None:
        state = view.state
        if state.status not in UNWINDING:
            raise Rejected(f"{kind}: workflow is {state.status}; only a failed workflow can be acted on")
        if data.step is not None and data.step not in view.comps:
            raise Rejected(f"{kind}: workflow has no step {data.step!r}")
        targets = [view.comps[data.step]] if data.step else list(view.comps.values())
        command = kind.removeprefix("operator-")
        touched = []
        for comp in targets:
            if operator_refusal(command, comp) is not None:
                continue
            if command == "retry":  # a fresh budget of attempts: the operator judged the cause fixed
                comp.status, comp.reason, comp.last_error, comp.spent = "pending", None, None, 0
                comp.retry_at = 0.0  # and no backoff left to wait
            elif command in ("resolve", "skip"):
                comp.status = "resolved" if command == "resolve" else "skipped"
            else:
                comp.approved = True
                if comp.status == "awaiting-approval":
                    comp.status = "pending"
            comp.reason = data.note or comp.reason
            view.put(comp, now)
            touched.append(comp.step)
        if data.step and not touched:  # a repeat, or a command that does not apply: say why, change nothing
            why = operator_refusal(command, view.comps[data.step])
            view.note(f"{kind}-ignored", now, data.step, by=data.by, detail=why)
            return
        view.note(kind, now, data.step, by=data.by, note=data.note, steps=",".join(touched))
        if touched and state.status in ("compensated", "needs-attention"):
            state.status = "compensating"

    # Unwinding ---------------------------------------------------------------------------

    def advance(self, view: WorkflowView, now: float) -> None:
        """Dispatch what may run next, then settle the workflow's status from its records."""
        state = view.state
        if state.status not in ("compensating", "needs-attention"):
            return
        lifo = sorted(view.comps.values(), key=completion_order, reverse=True)
        if state.parallel:
            for comp in lifo:
                if comp.status == "pending":
                    self._dispatch(view, comp, now)
        elif not any(c.status in IN_FLIGHT for c in lifo):  # one in flight; a late step waits its turn too
            for n, comp in enumerate(lifo):
                if comp.status in SETTLED:
                    continue
                if comp.status == "pending":
                    self._dispatch(view, comp, now, self._slip(comp, lifo[n + 1 :]))
                    break
                if state.on_failure == "halt":  # failed or awaiting approval blocks what lies below
                    break
        problems = [
            f"step {c.step}: {c.status}" + (f" ({c.last_error or c.reason})" if c.last_error or c.reason else "")
            for c in lifo
            if c.status in ("failed", "awaiting-approval", "unrecoverable", "in-doubt")
        ]
        missing = state.expected_steps - completions(view) if state.barrier_expired else 0
        if missing > 0:
            problems.insert(0, f"{missing} step(s) the orchestrator announced were never recorded")
        state.attention = "; ".join(problems)[:2000]
        statuses = {c.status for c in view.comps.values()}
        if statuses & IN_FLIGHT:
            state.status = "compensating"
        elif problems or "pending" in statuses:  # pending with nothing in flight: the unwind halted
            state.status = "needs-attention"
        else:
            state.status = "compensated"

    def _slip(self, head: Compensation, below: list[Compensation]) -> list[Compensation]:
        """The compensations one worker may run after `head` in the same job, in LIFO order.

        Only while each is auto-approved and ready (its plan complete, nothing to decide): the
        first one that is not ends the slip, as does one that halted (failed, awaiting approval).
        Steps that need nothing (settled) are passed over, as `advance` passes over them.
        """
        if not self.settings.slip or not self._slippable(head):
            return []
        slip: list[Compensation] = []
        for comp in below:
            if len(slip) >= self.settings.slip:
                break
            if comp.status in SETTLED:
                continue
            if comp.status != "pending" or not self._slippable(comp):
                break
            slip.append(comp)
        return slip

    def _slippable(self, comp: Compensation) -> bool:
        # A recall's result is the coordinator's to plan from (issue 14): it never rides in a slip.
        if comp.kind != "compensation":
            return False
        if not (comp.operation_id and comp.idempotency_key and comp.arguments is not None):
            return False
        return comp.approved or self.config.policy.decide(comp.server, comp.operation_id) == "auto"

    def _dispatch(
        self, view: WorkflowView, comp: Compensation, now: float, slip: list[Compensation] | None = None
    ) -> None:
        """Queue the next dispatch of `comp`, carrying `slip` behind it in the same job.

        A pending record with a retry still due (its failed attempt had no RQ retry behind it) is
        queued as a job RQ holds until then; silence counts from then too.
        """
        due = comp.retry_at if comp.status == "pending" and comp.retry_at > now else 0.0
        head = self._queue(view, comp, now, "", due=due)
        members = [self._queue(view, m, now, head.job_id, comp.step) for m in slip or ()]
        view.jobs.append(msgspec.structs.replace(head, then=tuple(members)) if members else head)

    def _queue(
        self, view: WorkflowView, comp: Compensation, now: float, via: str, head: str = "", due: float = 0.0
    ) -> CompensationJob:
        assert comp.operation_id and comp.idempotency_key and comp.arguments is not None
        comp.status = "queued"
        comp.dispatch += 1
        comp.attempt = 0
        comp.queued_at = now
        comp.heard_at = 0.0
        comp.retry_at = due
        comp.via = via
        view.put(comp, now)
        view.note(
            "recall-dispatched" if comp.kind == "recall" else "compensation-dispatched",
            now,
            comp.step,
            server=comp.server,
            operation=comp.operation_id,
            key=comp.idempotency_key,
            dispatch=comp.dispatch,
            late="yes" if comp.late else None,
            detail=f"in the routing slip of step {head}" if head else None,
        )
        return self.job_for(view.workflow, comp)

    def jobs_in_flight(self, view: WorkflowView) -> list[CompensationJob]:
        """The jobs the queued records call for, slips rebuilt: what a redelivered batch re-ensures."""
        queued = sorted((c for c in view.comps.values() if c.status == "queued"), key=completion_order, reverse=True)
        jobs = []
        for comp in queued:
            if comp.via:
                continue
            job = self.job_for(view.workflow, comp)
            members = tuple(self.job_for(view.workflow, m) for m in queued if m.via == job.job_id)
            jobs.append(msgspec.structs.replace(job, then=members) if members else job)
        return jobs

    def _revoke(self, view: WorkflowView, comp: Compensation, now: float) -> None:
        """Take back the compensations queued behind `comp` in its slip: `advance` decides them anew.

        The worker running the slip stops at the first record that is no longer queued under it.
        """
        slip = comp.via or (job_id_for(comp.idempotency_key, comp.dispatch) if comp.idempotency_key else "")
        for other in view.comps.values():
            if other is not comp and other.status == "queued" and other.via and other.via == slip:
                other.status, other.via = "pending", ""
                view.put(other, now)

    def job_for(self, workflow: str, comp: Compensation) -> CompensationJob:
        assert comp.operation_id and comp.idempotency_key and comp.arguments is not None
        return CompensationJob(
            workflow=workflow,
            step=comp.step,
            server=comp.server,
            tool=comp.tool,
            operation_id=comp.operation_id,
            arguments=comp.arguments,
            idempotency_key=comp.idempotency_key,
            dispatch=comp.dispatch,
            source=comp.source or "server",
            approved=comp.approved,
            prefix=self.prefix,
            seq=comp.seq,
            attempts_used=comp.spent,
            kind=comp.kind,
            not_before=comp.retry_at if comp.status == "queued" else 0.0,
        )

    def _touch(self, view: WorkflowView, before: str | None, now: float) -> None:
        state = view.state
        state.version += 1
        state.updated_at = now
        if state.status != before and state.status in ("compensated", "needs-attention", "completed"):
            view.note("status", now, status=state.status, attention=state.attention)
            self._outcome(view, f"workflow-{state.status}", now, None, state.status, state.attention or state.reason)

    def _outcome(
        self, view: WorkflowView, kind: str, now: float, step: str | None, status: str = "", reason: str = ""
    ) -> None:
        view.outcomes.append(
            Outcome(type=kind, workflow=view.workflow, at=now, step=step, status=status, reason=reason)
        )


def _iso(at: float) -> str:
    """An epoch time as the timeline and reasons show it (UTC, to the second)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _new_attempt(comp: Compensation, data: Report) -> bool:
    """Whether a report speaks of an attempt not yet counted: the current dispatch's, after the
    last one heard. A superseded dispatch's attempts were counted while it was current, or are
    charged by the watchdog that gave up on it; counting them again would spend the budget twice.
    """
    return data.dispatch == comp.dispatch and data.attempt > comp.attempt


def _count_attempt(comp: Compensation, data: Report) -> None:
    """A report that settles the step counts its attempt once: a success from a superseded
    dispatch still settles it (the effect is undone), but its attempt may be one already counted.
    """
    if _new_attempt(comp, data):
        comp.attempt, comp.attempts, comp.spent = data.attempt, comp.attempts + 1, comp.spent + 1


def _spread(comp: Compensation) -> float:
    """Where in the backoff's jitter this dispatch's retry falls, in [-1, 1]: drawn from its key,
    so the machine stays pure (a redelivered event folds to the same state) and compensations of
    many workflows that failed together still come back spread out.
    """
    return zlib.crc32(f"{comp.idempotency_key}/{comp.dispatch}".encode()) / 0xFFFF_FFFF * 2 - 1
