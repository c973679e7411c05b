"""The wire contract of `saga:events`: one msgspec Struct per event type.

Publishers in any language write plain stream entries with the fields `type`, `workflow`, `data`
(a JSON object) and optionally `v`. `decode_entry` is the single gate through which an entry
becomes a typed event; anything it rejects goes to the dead-letter stream with the reason it
returns, so its messages are written for the operator who will read them there.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct, field

WIRE_VERSION = 1
# A documented cap: an entry's `data` larger than this is dead-lettered, which keeps one hostile
# publisher from making the coordinator hold megabytes per step.
MAX_DATA_BYTES = 256 * 1024
# Also documented: JSON nested deeper than this inside `data` is dead-lettered. The coordinator
# re-encodes what it keeps (plans, jobs, templates) further down the stack than it decodes, so a
# value just inside msgspec's own recursion guard would pass here and raise RecursionError later,
# with the entry never acknowledged: every coordinator that claimed it would crash.
MAX_DEPTH = 128

WORKFLOW_ID = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$"
STEP_ID = r"^[A-Za-z0-9._:-]{1,64}$"
# Checked with fullmatch: Python's `$` also matches before a trailing newline, which the contract
# (and these patterns read as JSON Schema / ECMA-262) does not allow.
_WORKFLOW_RE = re.compile(WORKFLOW_ID)
_STEP_RE = re.compile(STEP_ID)

# Where an MCP client names the workflow a tool call belongs to (the gateway reads both): the request
# `_meta` key (reverse-DNS and ours, like every `_meta` key mcp-saga defines), else this HTTP header.
WORKFLOW_META_KEY = "io.github.mcp-saga/workflow"
WORKFLOW_HEADER = "Saga-Workflow"
# What the gateway adds to each recorded call's result `_meta`: the workflow and step it was recorded under.
STEP_META_KEY = "io.github.mcp-saga/step"


def check_workflow_id(workflow: object) -> str:
    """The workflow id, or ValueError saying what the contract requires."""
    if not isinstance(workflow, str) or not _WORKFLOW_RE.fullmatch(workflow):
        shown = workflow[:80] if isinstance(workflow, str) else workflow
        raise ValueError(f"invalid workflow id {shown!r} (must match {WORKFLOW_ID})")
    return workflow


def check_step_id(step: object) -> str:
    """The step id, or ValueError saying what the contract requires."""
    if not isinstance(step, str) or not _STEP_RE.fullmatch(step):
        shown = step[:80] if isinstance(step, str) else step
        raise ValueError(f"invalid step id {shown!r} (must match {STEP_ID})")
    return step


def stream_id(entry_id: str | bytes) -> tuple[int, int]:
    """A Redis stream entry id (`ms-seq`) as a pair that sorts like the stream; ValueError if it is none."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


StepId = Annotated[str, Meta(pattern=STEP_ID)]
Name = Annotated[str, Meta(min_length=1, max_length=128)]
TEXT_MAX = 8192  # characters of a free-text field (reasons, errors, notes)
BY_MAX = 200  # characters of an operator's name
Text = Annotated[str, Meta(max_length=TEXT_MAX)]


class Wire(Struct, rename="camel", omit_defaults=True, forbid_unknown_fields=False, frozen=True):
    """Base of every event payload: camelCase on the wire, unknown fields tolerated (forward compat)."""


class FailedStep(Wire):
    tool: str | None = None
    error: Text | None = None


class StepCompleted(Wire):
    TYPE: ClassVar[str] = "step-completed"
    step: StepId
    server: Name
    tool: Name
    result: dict[str, Any]
    arguments: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    completed_at: str | float | None = None


class WorkflowFailed(Wire):
    TYPE: ClassVar[str] = "workflow-failed"
    reason: Text = ""
    failed_step: FailedStep | None = None
    steps_completed: Annotated[int, Meta(ge=0, le=100_000)] | None = None
    # Per-workflow overrides of the coordinator's defaults.
    parallel: bool | None = None
    on_failure: Literal["halt", "continue"] | None = None


class WorkflowCompleted(Wire):
    TYPE: ClassVar[str] = "workflow-completed"
    pass


class Report(Wire):
    """What a worker says about one attempt at one compensation."""

    step: StepId
    dispatch: int = 0
    attempt: int = 1
    final: bool = True
    server: str | None = None
    operation_id: str | None = None
    idempotency_key: str | None = None
    arguments_digest: str | None = None
    duration_ms: float | None = None
    worker: str | None = None


class CompensationSucceeded(Report):
    TYPE: ClassVar[str] = "compensation-succeeded"
    result: dict[str, Any] | None = None


class CompensationFailed(Report):
    TYPE: ClassVar[str] = "compensation-failed"
    error: Text = ""
    retryable: bool = False


class CompensationRefused(Report):
    """The trust checks or the policy stopped the call before it reached the server."""

    TYPE: ClassVar[str] = "compensation-refused"

    status: Literal["awaiting-approval", "unrecoverable"] = "unrecoverable"
    reason: Text = ""


class OperatorCommand(Wire):
    step: StepId | None = None
    by: Annotated[str, Meta(max_length=BY_MAX)] = "operator"
    note: Text = ""


class OperatorRetry(OperatorCommand):
    TYPE: ClassVar[str] = "operator-retry"


class OperatorResolve(OperatorCommand):
    TYPE: ClassVar[str] = "operator-resolve"


class OperatorSkip(OperatorCommand):
    TYPE: ClassVar[str] = "operator-skip"


class OperatorApprove(OperatorCommand):
    TYPE: ClassVar[str] = "operator-approve"


Payload = (
    StepCompleted
    | WorkflowFailed
    | WorkflowCompleted
    | CompensationSucceeded
    | CompensationFailed
    | CompensationRefused
    | OperatorRetry
    | OperatorResolve
    | OperatorSkip
    | OperatorApprove
)
PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.TYPE: cls
    for cls in (
        StepCompleted,
        WorkflowFailed,
        WorkflowCompleted,
        CompensationSucceeded,
        CompensationFailed,
        CompensationRefused,
        OperatorRetry,
        OperatorResolve,
        OperatorSkip,
        OperatorApprove,
    )
}
_DECODERS = {name: msgspec.json.Decoder(cls) for name, cls in PAYLOAD_TYPES.items()}
_ENCODER = msgspec.json.Encoder()


class Event(Struct, frozen=True):
    """A decoded entry: `data` is the payload struct, `raw` the payload bytes as published."""

    id: str
    type: str
    workflow: str
    data: Payload
    raw: bytes
    v: int = WIRE_VERSION


class InvalidEvent(ValueError):
    """An entry that breaks the wire contract; the message is the dead-letter reason."""


def _text(fields: dict[bytes, bytes], name: str) -> str:
    value = fields.get(name.encode())
    if value is None:
        raise InvalidEvent(f"missing field {name!r}")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidEvent(f"field {name!r} is not valid UTF-8") from None


def decode_entry(entry_id: str, fields: dict[bytes, bytes]) -> Event:
    """Validate one stream entry against the contract, or say precisely why it does not fit."""
    kind = _text(fields, "type")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise InvalidEvent(f"unknown event type {kind[:80]!r}")
    workflow = _text(fields, "workflow")
    try:
        check_workflow_id(workflow)
    except ValueError as exc:
        raise InvalidEvent(str(exc)) from None
    version = fields.get(b"v", b"1")
    if version != b"1":
        raise InvalidEvent(f"unsupported wire version {version[:20]!r} (this coordinator speaks v1)")
    raw = fields.get(b"data")
    if raw is None:
        raise InvalidEvent("missing field 'data'")
    if len(raw) > MAX_DATA_BYTES:
        raise InvalidEvent(f"data is {len(raw)} bytes, over the {MAX_DATA_BYTES}-byte cap")
    try:  # msgspec skips unknown keys without reading them, and `raw` is stored and read elsewhere
        raw.decode()
    except UnicodeDecodeError:
        raise InvalidEvent("field 'data' is not valid UTF-8") from None
    try:
        data = decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidEvent(f"{kind} data: {exc}") from None
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _too_deep(data):  # counting first: cheap
        raise InvalidEvent(f"{kind} data: JSON nested deeper than {MAX_DEPTH} levels")
    step = getattr(data, "step", None)
    if step is not None:  # msgspec's pattern check uses re.search
        try:
            check_step_id(step)
        except ValueError as exc:
            raise InvalidEvent(f"{kind} data: {exc}") from None
    return Event(id=entry_id, type=kind, workflow=workflow, data=data, raw=raw)


def _too_deep(data: Struct) -> bool:
    """Whether a free-form (dict or list) field nests deeper than MAX_DEPTH, counting `data` as 1."""
    level = [v for v in msgspec.structs.astuple(data) if isinstance(v, dict | list)]
    depth = 2
    while level:
        if depth > MAX_DEPTH:
            return True
        below = []
        for node in level:
            below += [c for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, dict | list)]
        level, depth = below, depth + 1
    return False


def encode_payload(payload: Payload) -> bytes:
    return _ENCODER.encode(payload)


def entry_fields(workflow: str, payload: Payload) -> dict[str, bytes | str]:
    """The stream entry for a payload, as any publisher (or `redis-cli XADD`) would write it."""
    check_workflow_id(workflow)
    return {
        "type": payload.TYPE,
        "workflow": workflow,
        "data": encode_payload(payload),
    }
