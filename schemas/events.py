"""The wire contract of `saga:events`: one msgspec Struct per event type.

Publishers in any language write plain stream entries with the fields `type`, `workflow`, `data`
(a JSON object) and optionally `v`. `decode_entry` is the single gate through which an entry
becomes a typed event; anything it rejects goes to the dead-letter stream with the reason it
returns, so its messages are written for the operator who will read them there.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta, Struct, field

WIRE_VERSION = 1
# Revisions of the contract within wire version 1: each only adds (an event type, an optional
# field), so an entry valid under an older revision is valid under every later one. The exported
# JSON Schemas carry the revision a type was added in; a coordinator older than that revision
# dead-letters the type as unknown. Revision 2 added the intent and the in-doubt settling; revision 3
# the reading of a live declaration for a step whose event carried none.
CONTRACT_REVISION = 3
ADDED_IN_REVISION: dict[str, int] = {
    "step-started": 2,
    "recall-succeeded": 2,
    "recall-failed": 2,
    "declaration-read": 3,
    "declaration-failed": 3,
}
# A documented cap: an entry's `data` larger than this is dead-lettered, which keeps one hostile
# publisher from making the coordinator hold megabytes per step.
MAX_DATA_BYTES = 256 * 1024
# Entries up to this size are still read when over MAX_DATA_BYTES, so that the signal they carry
# (a failure, a step with effects) is not lost: what pushes them over the cap is cut or left out,
# with a note. Beyond it an entry is dead-lettered unread.
MAX_READ_BYTES = 16 * 1024 * 1024
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
TRACEPARENT_MAX = 128  # 55 for version 00; room for a future version's longer form
TRACESTATE_MAX = 512  # the W3C limit


class Wire(Struct, rename="camel", omit_defaults=True, forbid_unknown_fields=False, frozen=True):
    """Base of every event payload: camelCase on the wire, unknown fields tolerated (forward compat)."""


class TraceContext(Wire):
    """W3C trace context (https://www.w3.org/TR/trace-context/) of the span that produced the event.

    Optional and ignored by consumers that do not trace; a value that does not parse as a
    `traceparent` is ignored too, never a reason to refuse the event.
    """

    traceparent: Annotated[str, Meta(max_length=TRACEPARENT_MAX)]
    tracestate: Annotated[str, Meta(max_length=TRACESTATE_MAX)] | None = None


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
    trace: TraceContext | None = None  # the agent's span of this call (optional; older readers ignore it)


class StepStarted(Wire):
    """The intent, written (and acknowledged by Redis) before a tool call is forwarded.

    A started step that no `step-completed` of the same id settles is *in doubt*: the call may
    or may not have taken effect. `forward_key` is the call's idempotency key, sent to the server
    in the request `_meta` (`records.forward_key` defines it); it lets a worker ask an idempotent
    tool for the result of that very call instead of guessing. A publisher that never sends this
    event keeps the behaviour of wire v1 without it: only completed steps are recorded.
    """

    TYPE: ClassVar[str] = "step-started"
    step: StepId
    server: Name
    tool: Name
    forward_key: Annotated[str, Meta(min_length=1, max_length=200)]
    arguments: dict[str, Any] = field(default_factory=dict)
    recovery: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    started_at: str | float | None = None
    trace: TraceContext | None = None


class WorkflowFailed(Wire):
    TYPE: ClassVar[str] = "workflow-failed"
    reason: Text = ""
    failed_step: FailedStep | None = None
    steps_completed: Annotated[int, Meta(ge=0, le=100_000)] | None = None
    # Per-workflow overrides of the coordinator's defaults.
    parallel: bool | None = None
    on_failure: Literal["halt", "continue"] | None = None
    trace: TraceContext | None = None  # the agent's span of the workflow (optional; older readers ignore it)


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
    trace: TraceContext | None = None  # the worker's span of this attempt (optional; older readers ignore it)


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


class RecallSucceeded(Report):
    """The original tool of an in-doubt step answered a re-call with its forward key: `result` is
    what the first call did (or, when it never ran, what this call did), possibly `isError`."""

    TYPE: ClassVar[str] = "recall-succeeded"
    result: dict[str, Any] = field(default_factory=dict)


class RecallFailed(Report):
    """A re-call of an in-doubt step's tool got no answer (transport error, timeout) or was refused."""

    TYPE: ClassVar[str] = "recall-failed"
    error: Text = ""
    retryable: bool = False


class DeclarationRead(Report):
    """A worker listed the step's server live (for a step whose event carried no recovery): `recovery`
    is the tool's declaration as listed (None: it declares none), `annotations` the rest of its
    annotations, `listed` whether the server lists the tool at all, `listed_at` when (epoch seconds)."""

    TYPE: ClassVar[str] = "declaration-read"
    recovery: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    listed: bool = True
    listed_at: float = 0.0


class DeclarationFailed(Report):
    """A worker could not list the step's server (transport error, timeout) or was refused."""

    TYPE: ClassVar[str] = "declaration-failed"
    error: Text = ""
    retryable: bool = False


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
    | StepStarted
    | WorkflowFailed
    | WorkflowCompleted
    | CompensationSucceeded
    | CompensationFailed
    | CompensationRefused
    | RecallSucceeded
    | RecallFailed
    | DeclarationRead
    | DeclarationFailed
    | OperatorRetry
    | OperatorResolve
    | OperatorSkip
    | OperatorApprove
)
PAYLOAD_TYPES: dict[str, type[Payload]] = {
    cls.TYPE: cls
    for cls in (
        StepCompleted,
        StepStarted,
        WorkflowFailed,
        WorkflowCompleted,
        CompensationSucceeded,
        CompensationFailed,
        CompensationRefused,
        RecallSucceeded,
        RecallFailed,
        DeclarationRead,
        DeclarationFailed,
        OperatorRetry,
        OperatorResolve,
        OperatorSkip,
        OperatorApprove,
    )
}
_DECODERS = {name: msgspec.json.Decoder(cls) for name, cls in PAYLOAD_TYPES.items()}
_ENCODER = msgspec.json.Encoder()


class Event(Struct, frozen=True):
    """A decoded entry: `data` is the payload struct, `raw` the payload bytes as published.

    `repairs` says what decoding had to cut or leave out to keep the entry's signal (empty for an
    entry that kept to the contract); `raw` is then the repaired payload, as stored.
    """

    id: str
    type: str
    workflow: str
    data: Payload
    raw: bytes
    v: int = WIRE_VERSION
    repairs: tuple[str, ...] = ()


# The entry fields every decode reads, as the bytes the stream reply names them with.
_FIELD_NAMES = {"type": b"type", "workflow": b"workflow"}
# Workflow ids already checked (each workflow sends many events); a bounded cache, cleared when full.
_CHECKED_WORKFLOWS: set[str] = set()
# Step ids already checked against STEP_ID (workflows share their step names); bounded the same way.
_CHECKED_STEPS: set[str] = set()


class InvalidEvent(ValueError):
    """An entry that breaks the wire contract; the message is the dead-letter reason."""


def _text(fields: dict[bytes, bytes], name: str) -> str:
    value = fields.get(_FIELD_NAMES.get(name) or name.encode())
    if value is None:
        raise InvalidEvent(f"missing field {name!r}")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidEvent(f"field {name!r} is not valid UTF-8") from None


def decode_entry(entry_id: str, fields: dict[bytes, bytes], *, strict: bool = False) -> Event:
    """Validate one stream entry against the contract, or say precisely why it does not fit.

    The coordinator repairs what keeps its meaning (see `_repaired`); a publisher checks with
    `strict`, so that it never writes an entry that needs repair.
    """
    kind = _text(fields, "type")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise InvalidEvent(f"unknown event type {kind[:80]!r}")
    workflow = _text(fields, "workflow")
    if workflow not in _CHECKED_WORKFLOWS:
        try:
            check_workflow_id(workflow)
        except ValueError as exc:
            raise InvalidEvent(str(exc)) from None
        if len(_CHECKED_WORKFLOWS) >= 10_000:
            _CHECKED_WORKFLOWS.clear()
        _CHECKED_WORKFLOWS.add(workflow)
    version = fields.get(b"v", b"1")
    if version != b"1":
        raise InvalidEvent(f"unsupported wire version {version[:20]!r} (this coordinator speaks v1)")
    raw = fields.get(b"data")
    if raw is None:
        raise InvalidEvent("missing field 'data'")
    if len(raw) > MAX_READ_BYTES:
        raise InvalidEvent(f"data is {len(raw)} bytes, over the {MAX_READ_BYTES}-byte cap of what is read at all")
    # msgspec skips unknown keys without reading them, and `raw` is stored and read elsewhere. ASCII
    # (the common case: JSON escapes the rest) is UTF-8: checked in one pass, with no copy decoded.
    if not raw.isascii():
        try:
            raw.decode()
        except UnicodeDecodeError:
            raise InvalidEvent("field 'data' is not valid UTF-8") from None
    repairs: tuple[str, ...] = ()
    try:
        if len(raw) > MAX_DATA_BYTES:
            if strict:
                raise InvalidEvent(f"data is {len(raw)} bytes, over the {MAX_DATA_BYTES}-byte cap")
            raise msgspec.ValidationError("over the cap")
        data = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        if strict:
            raise InvalidEvent(f"{kind} data: {exc}") from None
        # Well-formed JSON that breaks a field's rule: keep what the event means when it can be
        # kept (a failure must still start the unwind), else dead-letter it with msgspec's reason.
        data, raw, repairs = _repaired(kind, raw, str(exc))
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidEvent(f"{kind} data: {exc}") from None
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _too_deep(data):  # counting first: cheap
        raise InvalidEvent(f"{kind} data: JSON nested deeper than {MAX_DEPTH} levels")
    # msgspec's pattern check uses re.search: the fullmatch runs once per step id.
    step = getattr(data, "step", None)
    if step is not None and not (type(step) is str and step in _CHECKED_STEPS):
        try:
            check_step_id(step)
        except ValueError as exc:
            raise InvalidEvent(f"{kind} data: {exc}") from None
        if len(_CHECKED_STEPS) >= 10_000:
            _CHECKED_STEPS.clear()
        _CHECKED_STEPS.add(step)
    return Event(id=entry_id, type=kind, workflow=workflow, data=data, raw=raw, repairs=repairs)


_DROP = object()
# Fields whose value may be replaced by an empty one when an entry is over MAX_DATA_BYTES, largest
# first in practice; a binding that reads them then fails to resolve and says so (never a guess).
_SHEDDABLE = ("annotations", "result", "arguments")


def field_repair(repairs: tuple[str, ...], name: str) -> str | None:
    """The note saying decoding left out or cut the top-level field `name`, if it did.

    An intent whose arguments were left out must not be called again with what remains: that
    would be a call with guessed arguments (SEP-3172 4.2). The notes are made in this module
    (`_fit_struct`, `_repaired`), as `NAME: ...` or `NAME (N bytes) ...`."""
    return next((note for note in repairs if note.startswith((f"{name}:", f"{name} ("))), None)


def cut_text(text: str, limit: int) -> str:
    """`text` within `limit` characters, its end replaced by a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(f" [... {len(text)} more characters cut]"))
    return text[:keep] + f" [... {len(text) - keep} more characters cut]"


def _repaired(kind: str, raw: bytes, why: str) -> tuple[Payload, bytes, tuple[str, ...]]:
    cls = PAYLOAD_TYPES[kind]
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidEvent(f"{kind} data: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidEvent(f"{kind} data: {why}")
    notes: list[str] = []
    fixed = _fit_struct(cls, obj, notes, "", kind, why)
    encoded = _ENCODER.encode(fixed)
    if len(encoded) > MAX_DATA_BYTES:
        known = {f.encode_name for f in msgspec.structs.fields(cls)}
        unknown = sorted(k for k in fixed if k not in known)
        if unknown:
            fixed = {k: v for k, v in fixed.items() if k in known}
            notes.append(f"unknown field(s) {', '.join(unknown)[:200]} left out: the entry was over the cap")
        for name in _SHEDDABLE:
            if len(encoded := _ENCODER.encode(fixed)) <= MAX_DATA_BYTES:
                break
            if fixed.get(name):
                size = len(_ENCODER.encode(fixed[name]))
                fixed[name] = {}
                notes.append(f"{name} ({size} bytes) left out: the entry was over the {MAX_DATA_BYTES}-byte cap")
        encoded = _ENCODER.encode(fixed)
        if len(encoded) > MAX_DATA_BYTES:
            raise InvalidEvent(f"data is {len(raw)} bytes, over the {MAX_DATA_BYTES}-byte cap")
    try:
        return _DECODERS[kind].decode(encoded), encoded, tuple(notes)
    except msgspec.ValidationError as exc:  # a rule no repair covers: say what msgspec said
        raise InvalidEvent(f"{kind} data: {exc}") from None


def _fit_struct(
    cls: type[Struct], obj: dict[str, Any], notes: list[str], prefix: str, kind: str, why: str
) -> dict[str, Any]:
    """`obj` with each field that breaks its rule cut (texts) or left out (optional fields).

    A mistyped `recovery` is kept as a declaration that cannot be parsed, not left out: a step
    without one would be `skipped` as if it had nothing to undo, where the truth is unrecoverable.
    """
    fixed = dict(obj)
    for f in msgspec.structs.fields(cls):
        if f.encode_name not in obj:
            continue
        value = obj[f.encode_name]
        try:
            msgspec.convert(value, f.type)
            continue
        except msgspec.ValidationError as exc:
            got = f"{type(value).__name__} {str(exc).lower()}, the contract wants {_describe(f.type)}"
        path = prefix + f.encode_name
        repaired = _fit_value(f.type, value, notes, path, kind, why)
        if repaired is not _DROP:
            fixed[f.encode_name] = repaired
        elif f.required:
            raise InvalidEvent(f"{kind} data: {why}")
        elif f.encode_name == "recovery":
            fixed[f.encode_name] = {"invalidDeclaration": type(value).__name__}
            notes.append(f"{path}: {got}; kept as an invalid declaration (the step is unrecoverable)")
        else:
            del fixed[f.encode_name]
            notes.append(f"{path}: {got}; left out")
    return fixed


def _fit_value(tp: Any, value: Any, notes: list[str], path: str, kind: str, why: str) -> Any:
    for option in _options(tp):
        base, limit = _text_limit(option)
        if base is str and isinstance(value, str) and limit in (TEXT_MAX, BY_MAX):  # free text, not names
            notes.append(f"{path}: {len(value)} characters, cut to {limit}")
            return cut_text(value, limit)
        if isinstance(option, type) and issubclass(option, Struct) and isinstance(value, dict):
            return _fit_struct(option, value, notes, path + ".", kind, why)
    return _DROP


def _options(tp: Any) -> tuple[Any, ...]:
    if get_origin(tp) in (Union, UnionType):
        return tuple(a for a in get_args(tp) if a is not type(None))
    return (tp,)


def _text_limit(tp: Any) -> tuple[Any, int | None]:
    if get_origin(tp) is Annotated:
        base, *metas = get_args(tp)
        limits = [m.max_length for m in metas if isinstance(m, Meta) and m.max_length is not None]
        return base, limits[0] if limits else None
    return tp, None


def _describe(tp: Any) -> str:
    names = []
    for option in _options(tp):
        base, _ = _text_limit(option)
        if get_origin(base) is Literal:
            names.append(" or ".join(repr(a) for a in get_args(base)))
        else:
            names.append(getattr(base, "__name__", str(base)))
    return " or ".join(names)


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
