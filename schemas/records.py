"""What mcp-saga stores per workflow and what it hands a worker.

`WorkflowState` is the `saga:{wf}:state` hash (flat string fields, so `redis-cli HGETALL` reads
well); `Compensation` is one value of the `saga:{wf}:comp` hash (JSON); `CompensationJob` is the
argument of the RQ job. Each is defined once here and used by the coordinator, the workers and
the CLI alike.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, get_args

import msgspec
from msgspec import Struct

WorkflowStatus = Literal["running", "failed", "compensating", "compensated", "needs-attention", "completed"]
CompStatus = Literal[
    "pending",
    "queued",
    "running",
    "succeeded",
    "failed",
    "skipped",
    "unrecoverable",
    "awaiting-approval",
    "resolved",
    "started",
    "in-doubt",
]
JobKind = Literal["compensation", "recall", "declaration"]
WORKFLOW_STATUSES: tuple[str, ...] = get_args(WorkflowStatus)
COMP_STATUSES: tuple[str, ...] = get_args(CompStatus)
# A compensation in one of these states needs nothing more from the coordinator.
SETTLED: frozenset[str] = frozenset({"succeeded", "skipped", "unrecoverable", "resolved"})
IN_FLIGHT: frozenset[str] = frozenset({"queued", "running"})
# A step whose call was announced (step-started) and not yet settled: its outcome is unknown.
# `started` while the workflow runs (the call may still answer), `in-doubt` once the workflow is
# unwinding and nothing can settle it automatically (an operator must).
OPEN: frozenset[str] = frozenset({"started", "in-doubt"})
# What wire revision 2 (issue 14: intents, in-doubt steps, recalls) added to the stored records, by
# wire name; a reader of revision 1 ignores the fields and knows neither status. The exported
# schemas say so (schemas/export.py).
RECORD_FIELDS_OF_REVISION_2 = ("forwardKey", "inDoubt", "openIntent", "failedCall", "kind", "ifInDoubt", "recovery")
JOB_FIELDS_OF_REVISION_2 = ("kind",)
# Revision 3 (issue 13: a step whose event carried no recovery is planned from the server's live
# declaration): the record's `result` (what the plan is made from once the declaration is read)
# and the `declaration` value of the record's and the job's `kind`.
RECORD_FIELDS_OF_REVISION_3 = ("result",)
KINDS_ADDED_IN_REVISION: dict[str, int] = {"recall": 2, "declaration": 3}
# Workflow statuses after which new step events are late.
UNWINDING: frozenset[str] = frozenset({"failed", "compensating", "compensated", "needs-attention"})


class WorkflowState(Struct, rename="camel", omit_defaults=True):
    """The state hash. Absent workflow == `WorkflowState(version=0)`."""

    status: WorkflowStatus = "running"
    version: int = 0
    steps: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0
    reason: str = ""
    failed_tool: str = ""
    expected_steps: int = 0
    barrier_deadline: float = 0.0
    parallel: bool = False
    on_failure: Literal["halt", "continue"] = "halt"
    barrier_expired: bool = False
    attention: str = ""

    def to_hash(self) -> dict[str, str]:
        return {_ENCODE_NAMES[k]: _flat(v) for k, v in msgspec.structs.asdict(self).items()}


def _flat(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


_ENCODE_NAMES = {f.name: f.encode_name for f in msgspec.structs.fields(WorkflowState)}
_KNOWN = frozenset(_ENCODE_NAMES.values())


def state_from_hash(raw: dict[bytes, bytes]) -> WorkflowState:
    """Read the state hash back; fields a newer version added are ignored."""
    data = {k.decode(): v.decode() for k, v in raw.items()}
    return msgspec.convert({k: v for k, v in data.items() if k in _KNOWN}, WorkflowState, strict=False)


class Compensation(Struct, rename="camel", omit_defaults=False):
    """One step's compensation record: the plan, and where it stands."""

    step: str
    seq: int
    server: str
    tool: str
    status: CompStatus
    operation_id: str | None = None
    arguments: dict[str, Any] | None = None
    idempotency_key: str | None = None
    source: Literal["server", "overlay"] | None = None
    attempts: int = 0
    dispatch: int = 0
    attempt: int = 0
    last_error: str | None = None
    reason: str | None = None
    late: bool = False
    approved: bool = False
    queued_at: float = 0.0
    updated_at: float = 0.0
    # Stream id of the step's step-completed entry. LIFO follows it, not `seq` (arrival order): a
    # step claimed from a crashed coordinator arrives after later ones but must still be undone after them.
    event_id: str = ""
    # Last word about the current dispatch: an attempt report, or its worker's lease seen alive by
    # the watchdog. The watchdog counts silence from here (or from `queued_at`), not from dispatch.
    heard_at: float = 0.0
    # Attempts used since the plan or the last operator retry, across dispatches: a re-dispatch by
    # the watchdog continues this budget instead of starting a fresh one.
    spent: int = 0
    # The forward call's idempotency key, for a step recorded from its intent (step-started).
    forward_key: str | None = None
    # Whether the step was ever in doubt (its workflow unwound before its outcome was known).
    in_doubt: bool = False
    # A started step whose step-completed has not arrived: not counted as completed by the barrier.
    open_intent: bool = False
    # An intent settled by an `isError` answer: a failed call, which `stepsCompleted` does not count.
    failed_call: bool = False
    # What a dispatch of this record does: undo the step, or (for an in-doubt step of an
    # idempotent tool) call the original tool again with its forward key to learn its result, or
    # (for a step whose event carried no recovery) read the server's live declaration of the tool.
    kind: JobKind = "compensation"
    # For a started step: the status its plan takes if the workflow unwinds before the step is
    # settled, and the recovery declaration its intent carried (a recall's result is planned with it).
    if_in_doubt: CompStatus | None = None
    recovery: dict[str, Any] | None = None
    # When the retry RQ scheduled after the current dispatch's last failed attempt is due at the
    # latest (0: none waits): silence counts from here, so a retry's backoff is never silence. For a
    # failed step of a routing slip (no RQ retry behind it): when its next dispatch may run.
    retry_at: float = 0.0
    # A `declaration` record: the step's recorded result, which the plan binds once the live
    # declaration is read (`arguments` holds its recorded arguments meanwhile).
    result: dict[str, Any] | None = None
    # The RQ job id of the routing slip that carries this dispatch behind the slip's first step
    # ('' when the dispatch is a job of its own): the watchdog reads that job's status.
    via: str = ""


# The RQ job function a CompensationJob runs (its payload the job's JSON), named for RQ to import.
JOB_FUNCTION = "mcp_saga.workers.job.compensate"


class CompensationJob(Struct, rename="camel", frozen=True):
    """Everything a worker needs to perform one compensation, resolved by the coordinator."""

    workflow: str
    step: str
    server: str
    tool: str
    operation_id: str
    arguments: dict[str, Any]
    idempotency_key: str
    dispatch: int
    source: Literal["server", "overlay"] = "server"
    approved: bool = False
    prefix: str = "saga"
    # The step's place on the stack, so the worker reads the step with the record (-1: unknown).
    seq: int = -1
    # Attempts earlier dispatches of this compensation already used: this dispatch may make only
    # `attempts - attemptsUsed` more (the coordinator sizes the RQ Retry accordingly).
    attempts_used: int = 0
    # W3C trace context (`traceparent`, `tracestate`) of the transition that dispatched this job.
    trace: dict[str, str] | None = None
    # `recall`: `operation_id` is the step's own tool, `arguments` its original arguments and
    # `idempotency_key` its forward key; the worker reports recall-succeeded / recall-failed.
    # `declaration`: `operation_id` is the step's own tool, which is not called: the worker reads the
    # server's live tools/list and reports declaration-read / declaration-failed.
    kind: JobKind = "compensation"
    # The routing slip: compensations to run after this one, in this order, once it succeeded and
    # while each next one's record still says it is queued under this slip (see workers/job.py).
    then: tuple[CompensationJob, ...] = ()
    # Epoch seconds before which the job must not run (0: at once): a re-dispatch after a failed
    # attempt that had no RQ retry behind it (a step of a routing slip) waits out the backoff.
    not_before: float = 0.0

    @property
    def job_id(self) -> str:
        """RQ job id: one per (compensation, dispatch), so a re-dispatch is a new job, a redelivery is not."""
        return job_id_for(self.idempotency_key, self.dispatch)


def job_id_for(key: str, dispatch: int) -> str:
    """The RQ job id of one dispatch of the compensation with idempotency key `key`."""
    return f"saga-{_digest(key)}-{dispatch}"


def idempotency_key(workflow: str, step: str, operation_id: str) -> str:
    """The one key of a compensation: stable across retries, redeliveries, restarts and processes."""
    return "saga:" + _digest("\x1f".join((workflow, step, operation_id)), 32)


def forward_key(workflow: str, step: str) -> str:
    """The idempotency key of a step's forward call: derivable by any publisher from the two ids.

    It travels in the call's request `_meta` under `IDEMPOTENCY_META_KEY`, the same key as a
    compensation's, so a server honours both with one rule; the `fwd` prefix keeps the two apart.
    """
    return "saga:fwd:" + _digest("\x1f".join((workflow, step)), 32)


def arguments_digest(arguments: dict[str, Any] | None) -> str:
    return _digest(msgspec.json.encode(arguments, order="sorted"), 16)


def _digest(text: str | bytes, size: int = 20) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()[:size]


comp_encoder = msgspec.json.Encoder()
comp_decoder = msgspec.json.Decoder(Compensation)
job_decoder = msgspec.json.Decoder(CompensationJob)
