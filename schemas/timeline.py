"""What the coordinator writes to its three streams of record: timeline entries, outcomes, dead letters.

`saga:{wf}:log` (the workflow's timeline), `saga:outcomes` (what became of workflows and
compensations) and `saga:dead-letter` (events refused) are read by operators with `redis-cli XRANGE`,
so their entries are flat string fields. Each kind is one struct here with its own mapping to those
fields, as `WorkflowState.to_hash`/`state_from_hash` are for the state hash: the coordinator builds
structs, the store encodes them, the reader decodes them, and the field names and values on the wire
are decided in this one place.

Decoding is tolerant: fields this version does not know (written by a newer one), or values that do
not parse as their field's type, are kept as text in `extra`, so an old or newer entry still reads and
shows everything it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

import msgspec
from mcp_saga.schemas.keys import DEAD_AT, DEAD_ID, DEAD_REASON
from msgspec import Struct

# Outcomes carry a reason at most this long: `saga:outcomes` is a notification, the timeline holds the rest.
OUTCOME_REASON_MAX = 2000


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class FlatEntry(Struct, kw_only=True):
    """A stream entry as a struct: each field under its own name, empty and absent fields left out."""

    # Stream id of the entry when read back; not a field of the entry itself.
    id: str = ""
    # Fields a reader did not recognise, as text (see the module docstring).
    extra: dict[str, str] = {}

    # Fields written with a fixed number format (a float's `str` would change with its value).
    FORMATS: ClassVar[dict[str, str]] = {"at": "{:.6f}"}
    # Whether `id` is a field of the entry (an outcome's own name) rather than only its stream id.
    ID_ON_WIRE: ClassVar[bool] = False

    def to_fields(self) -> dict[str, str]:
        """The stream entry's fields, for XADD (or the Lua scripts that XADD)."""
        fields: dict[str, str] = {}
        for name in self.__struct_fields__:
            if name in ("id", "extra"):
                continue
            value = getattr(self, name)
            if value is None or value == "":
                continue
            fmt = self.FORMATS.get(name)
            fields[name] = fmt.format(value) if fmt else str(value)
        fields.update({k: v for k, v in self.extra.items() if k not in fields})
        if self.ID_ON_WIRE and self.id:
            fields["id"] = self.id
        return fields

    def to_json(self) -> dict[str, str]:
        """The entry as `saga inspect --json` shows it: its stream id, then its fields."""
        return {"id": self.id, **self.to_fields()} if self.id else self.to_fields()

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes] | Mapping[str, str], entry_id: bytes | str = "") -> Self:
        """Decode a stream entry's fields; see the module docstring for what is unknown or unparsable."""
        types = _field_types(cls)
        known: dict[str, Any] = {}
        extra: dict[str, str] = {}
        for key, value in raw.items():
            name, text = _text(key), _text(value)
            if name == "id" and cls.ID_ON_WIRE and not entry_id:
                entry_id = text
            elif name in types and name not in ("id", "extra"):
                known[name] = text
            else:
                extra[name] = text
        known.setdefault("type", "?")  # required: an entry without one still reads, under an honest name
        try:  # one conversion for the whole entry: the common case, and far cheaper than one per field
            return msgspec.convert({**known, "id": _text(entry_id), "extra": extra}, cls, strict=False)
        except msgspec.ValidationError:
            pass
        for name, text in list(known.items()):
            try:
                known[name] = msgspec.convert(text, types[name], strict=False)
            except msgspec.ValidationError:
                extra[name] = known.pop(name)
        return cls(**known, id=_text(entry_id), extra=extra)


_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    if cls not in _TYPES:
        _TYPES[cls] = {f.name: f.type for f in msgspec.structs.fields(cls)}
    return _TYPES[cls]


class TimelineEntry(FlatEntry, kw_only=True):
    """One entry of `saga:{wf}:log`. `type` says what happened; the other fields are its details."""

    type: str
    at: float = 0.0
    step: str | None = None
    event: str | None = None
    tool: str | None = None
    plan: str | None = None
    operation: str | None = None
    source: str | None = None
    server: str | None = None
    key: str | None = None
    digest: str | None = None
    status: str | None = None
    reason: str | None = None
    error: str | None = None
    retryable: bool | None = None
    attempt: int | None = None
    dispatch: int | None = None
    duration_ms: float | None = None
    worker: str | None = None
    late: str | None = None
    by: str | None = None
    note: str | None = None
    steps: str | None = None
    attention: str | None = None
    detail: str | None = None
    # The stream id of the event a `workflow-completed` entry records: two coordinators of one group
    # may fold a workflow's last step after its completion (a `late-step`), and only the two ids
    # (the step's is its record's `eventId`) say whether the stream had them in that order.
    entry: str | None = None

    FORMATS: ClassVar[dict[str, str]] = {"at": "{:.6f}", "duration_ms": "{:.1f}"}

    def details(self) -> dict[str, str]:
        """The fields besides type, time and step (and `id`), as written: what a row of details shows."""
        return {k: v for k, v in self.to_fields().items() if k not in ("type", "at", "step")}


class Outcome(FlatEntry, kw_only=True):
    """One entry of `saga:outcomes`: a workflow or a compensation reached a result someone may act on.

    `id` names the outcome across re-sends (the outbox may write it more than once), so unlike a
    timeline entry's it is a field of the entry.
    """

    type: str
    workflow: str = ""
    at: float = 0.0
    step: str | None = None
    status: str | None = None
    reason: str | None = None

    ID_ON_WIRE: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.reason:
            self.reason = self.reason[:OUTCOME_REASON_MAX]


class DeadLetter(Struct, frozen=True):
    """One entry of `saga:dead-letter`: the refused event's fields under their own names, ours prefixed.

    `fields` are the original entry's, as text (for reading); `record` writes the original bytes.
    """

    id: str
    at: str | None
    reason: str
    original_id: str | None
    fields: dict[str, str]

    @staticmethod
    def record(original_id: bytes, fields: Mapping[bytes, bytes], reason: str, at: float) -> dict[bytes, bytes]:
        """The dead-letter entry for a refused event: its fields byte for byte, plus why, which and when."""
        entry = {
            DEAD_REASON.encode(): reason.encode(),
            DEAD_ID.encode(): original_id,
            DEAD_AT.encode(): f"{at:.3f}".encode(),
        }
        entry.update({k: v for k, v in fields.items() if not k.startswith(b"dead.")})
        return entry

    @classmethod
    def from_fields(cls, entry_id: bytes | str, raw: Mapping[bytes, bytes]) -> DeadLetter:
        data = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            id=_text(entry_id),
            at=data.pop(DEAD_AT, None),
            reason=data.pop(DEAD_REASON, ""),
            original_id=data.pop(DEAD_ID, None),
            fields=data,
        )
