"""Hostile input on `saga:events`: hypothesis-generated entries against the coordinator on a real Redis.

Publishers in any language write plain XADDs, so `decode_entry` and the state machine are all that
stand between a buggy or hostile publisher and workflow state. The property checked here, for
every generated entry: it is acknowledged, and it either lands in `saga:dead-letter` with a reason
and its original fields, or it is handled as the contract says (the step is recorded, the status
moves). Meanwhile the coordinator never raises, every workflow's keys stay mutually consistent,
and a valid workflow interleaved with the garbage is compensated in LIFO order with the right
arguments (driven by publishing `compensation-succeeded` for each job it queues).

Entries are built as scenarios, each on its own workflow, then interleaved at random: a scenario
knows what each of its entries must do (`dead`, `handled`, or `either` for free-form noise where
only the invariants are checked) and which statuses its workflow may end in.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.coordinator.machine import completion_order
from mcp_saga.schemas.config import Config, CoordinatorSettings, parse_config, write_config
from mcp_saga.schemas.events import (
    MAX_DATA_BYTES,
    MAX_DEPTH,
    PAYLOAD_TYPES,
    STEP_ID,
    WORKFLOW_ID,
    InvalidEvent,
    decode_entry,
)
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import IN_FLIGHT, SETTLED, CompensationJob, comp_decoder, job_decoder, state_from_hash
from processes import saga_process, stop, wait_for
from rq import Queue
from rq.job import Job

K = Keys()
TYPES = sorted(PAYLOAD_TYPES)
REPORTS = ["compensation-succeeded", "compensation-failed", "compensation-refused"]
OPERATOR = ["operator-retry", "operator-resolve", "operator-skip", "operator-approve"]
WF_RE = re.compile(WORKFLOW_ID)
STEP_RE = re.compile(STEP_ID)
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {
        "operationId": "release",
        "parameters": {"id": "$response.body#/id", "sku": "$request.body#/sku", "note": "undo {$response.body#/id}"},
    },
}
Expect = Literal["dead", "handled", "either"]


@dataclass
class Entry:
    fields: dict[bytes, bytes]
    expect: Expect
    # For a handled step-completed: (workflow, step, whether this is the step's first appearance).
    step: tuple[str, str, bool] | None = None
    # For a dead one: a phrase the dead-letter reason must contain, when the cause is unambiguous.
    reason: str | None = None


@dataclass
class Scenario:
    workflow: str | None
    entries: list[Entry]
    # Statuses the workflow may end in once everything is ingested (None: no state expected).
    final: Collection[str] | None = None
    good: bool = False
    steps: list[str] = field(default_factory=list)


def enc(obj: Any, ascii_only: bool = True) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only).encode()


def fields(kind: str | bytes, workflow: str | bytes, data: bytes, **extra: bytes) -> dict[bytes, bytes]:
    out = {
        b"type": kind.encode() if isinstance(kind, str) else kind,
        b"workflow": workflow.encode() if isinstance(workflow, str) else workflow,
        b"data": data,
    }
    out.update({k.encode(): v for k, v in extra.items()})
    return out


def step_data(step: str, recovery: Any = RECOVERY, **more: Any) -> dict[str, Any]:
    return {
        "step": step,
        "server": "svc",
        "tool": "reserve",
        "arguments": {"sku": f"sku-{step}", "qty": 1},
        "result": {"structuredContent": {"id": f"r-{step}"}, "content": [], "isError": False},
        "recovery": recovery,
        "completedAt": "2026-11-01T00:00:00Z",
        **more,
    }


def report_data(kind: str, step: str, dispatch: int = 1) -> dict[str, Any]:
    data: dict[str, Any] = {"step": step, "dispatch": dispatch, "attempt": 1, "final": True}
    if kind == "compensation-failed":
        data["error"] = "boom"
    if kind == "compensation-refused":
        data.update(status="awaiting-approval", reason="policy")
    return data


def pad_to(obj: dict[str, Any], size: int) -> bytes:
    """The object with an unknown `pad` key sized so that its JSON is exactly `size` bytes."""
    base = enc({**obj, "pad": ""})
    return enc({**obj, "pad": "x" * (size - len(base))})


def splice(obj: dict[str, Any], marker_value: bytes) -> bytes:
    """JSON of `obj` with the string "@@" replaced by raw bytes (invalid UTF-8, escapes, deep JSON)."""
    return enc(obj).replace(b'"@@"', marker_value)


# Strategies: ids and bytes ----------------------------------------------------------------------

ID_CHARS = "abcXYZ019._:-"
ok_text = st.text(alphabet=ID_CHARS, max_size=8)
step_ids = st.from_regex(r"[A-Za-z0-9._:-]{1,64}", fullmatch=True)
bad_utf8 = st.sampled_from(
    [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xfe\xfe"]
)
bad_workflow_ids = st.one_of(
    st.sampled_from(
        ["", " ", "a b", "{a}", "a}", "{", "}", "a\n", "\na", "a\r\n", "-x", ".x", "@x", "a/b", "é", "a\x00"]
    ),
    st.builds(lambda a, c, b: "w" + a + c + b, ok_text, st.sampled_from("{} \n\t/\\\"'é*?"), ok_text),
    st.integers(201, 300).map(lambda n: "w" * n),
    st.text(max_size=30).filter(lambda s: not WF_RE.fullmatch(s)),
).map(str.encode)
bad_step_ids = st.one_of(
    st.sampled_from(["", " ", "a b", "{a}", "a}", "a\n", "\n", "a@b", "a/b", "é", "x" * 65, "a\x00"]),
    st.builds(lambda a, c, b: a + c + b, ok_text, st.sampled_from("{} \n\t/@é"), ok_text),
    st.text(max_size=80).filter(lambda s: not STEP_RE.fullmatch(s)),
)


@st.composite
def with_bad_utf8(draw: st.DrawFn, valid: bytes) -> bytes:
    at = draw(st.integers(0, len(valid)))
    return valid[:at] + draw(bad_utf8) + valid[at:]


json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
extra_fields = st.dictionaries(
    st.binary(min_size=0, max_size=12).filter(lambda k: k not in (b"type", b"workflow", b"data", b"v")),
    st.binary(max_size=40),
    max_size=3,
)


# Strategies: scenarios, each on its own workflow ------------------------------------------------


@st.composite
def broken_entry(draw: st.DrawFn, wf: str) -> Scenario:
    """One entry that breaks the contract in exactly one way.

    It must be dead-lettered, unless what it means survives the break (a text over its cap, a
    mistyped optional field, an entry over the size cap because of what can be left out): then
    decoding repairs it and it must be handled, so that a failure or a step is never lost.
    """
    kind = draw(st.sampled_from(["step-completed", "workflow-failed", "workflow-completed"]))
    step = draw(step_ids)
    good = {"step-completed": step_data(step), "workflow-failed": {"reason": "x"}, "workflow-completed": {}}[kind]
    f = fields(kind, wf, enc(good))
    reason: str | None = None
    repaired = False
    how = draw(
        st.sampled_from(
            [
                "type-unknown", "type-utf8", "type-missing", "workflow-bad", "workflow-utf8", "workflow-missing",
                "v", "data-missing", "data-not-json", "data-not-object", "data-utf8", "data-surrogate",
                "data-oversize", "step-deep", "step-missing", "step-wrong-type", "step-bad-id", "failed-wrong-type",
                "huge-field",
            ]
        )
    )  # fmt: skip
    if how == "type-unknown":
        f[b"type"] = draw(
            st.one_of(
                st.sampled_from(["", "Step-Completed", "step-completed\n", " step-completed", "step_completed", "v2"]),
                st.text(max_size=40),
            ).filter(lambda t: t not in PAYLOAD_TYPES)
        ).encode()
        reason = "unknown event type"
    elif how == "type-utf8":
        f[b"type"] = draw(with_bad_utf8(kind.encode()))
        reason = "'type' is not valid UTF-8"
    elif how == "type-missing":
        del f[b"type"]
        reason = "missing field 'type'"
    elif how == "workflow-bad":
        f[b"workflow"] = draw(bad_workflow_ids)
        reason = "invalid workflow id"
    elif how == "workflow-utf8":
        f[b"workflow"] = draw(with_bad_utf8(wf.encode()))
        reason = "'workflow' is not valid UTF-8"
    elif how == "workflow-missing":
        del f[b"workflow"]
        reason = "missing field 'workflow'"
    elif how == "v":
        f[b"v"] = draw(st.sampled_from([b"2", b"0", b"", b"01", b"1 ", b"1.0", b"\xff", b"v1", b"-1", b"1\n"]))
        reason = "unsupported wire version"
    elif how == "data-missing":
        del f[b"data"]
        reason = "missing field 'data'"
    elif how == "data-not-json":
        f[b"data"] = draw(st.sampled_from([b"", b"{", b"nul", b"{'a':1}", b"{} x", b"\xef\xbb\xbf{}", b'{"a":1,}']))
    elif how == "data-not-object":
        f[b"data"] = draw(st.sampled_from([b"[]", b"1", b'"s"', b"null", b"true", b"[{}]", b"1e400"]))
    elif how == "data-utf8":
        marker = {"step-completed": "tool", "workflow-failed": "reason", "workflow-completed": "x"}[kind]
        f[b"data"] = splice({**good, marker: "@@"}, b'"a' + draw(bad_utf8) + b'b"')
    elif how == "data-surrogate":
        marker = {"step-completed": "tool", "workflow-failed": "reason", "workflow-completed": "note"}[kind]
        escape = draw(st.sampled_from([b"\\ud800", b"\\udfff", b"a\\ud83d", b"\\udc00\\ud800", b"\\ud800\\u0041"]))
        f[b"data"] = splice({**good, marker: "@@"}, b'"' + escape + b'"')
    elif how == "huge-field":  # only `data` is capped; the others are bounded by their own rules
        name = draw(st.sampled_from([b"type", b"workflow", b"v"]))
        f[name] = b"x" * draw(st.integers(100_000, 1_000_000))
        reason = {b"type": "unknown event type", b"workflow": "invalid workflow id", b"v": "wire version"}[name]
    elif how == "data-oversize":
        f[b"data"] = pad_to(good, MAX_DATA_BYTES + draw(st.integers(1, 4096)))
        repaired = kind != "step-completed" or bool(STEP_RE.fullmatch(step))  # the padding is left out
    elif how == "step-deep":
        # data is level 1 and the field level 2, so MAX_DEPTH - 1 arrays inside it are one too many.
        depth = draw(st.sampled_from([MAX_DEPTH - 1, MAX_DEPTH + 10, 990, 995, 1000, 5000, 100_000]))
        where = draw(st.sampled_from(["arguments", "result", "recovery", "annotations"]))
        deep = b"[" * depth + b"]" * depth
        f = fields("step-completed", wf, splice(step_data(step, **{where: {"x": "@@"}}), deep))
    elif how == "step-missing":
        dropped = draw(st.sampled_from(["step", "server", "tool", "result"]))
        f = fields("step-completed", wf, enc({k: v for k, v in step_data(step).items() if k != dropped}))
        reason = "missing required field"
    elif how == "step-wrong-type":
        key, value = draw(
            st.sampled_from(
                [
                    ("step", 5), ("step", None), ("server", ""), ("server", "s" * 129), ("tool", None),
                    ("tool", ["t"]), ("result", "ok"), ("result", None), ("result", []), ("arguments", []),
                    ("arguments", "a"), ("recovery", "r"), ("recovery", []), ("annotations", 1),
                    ("completedAt", {}), ("server", 1),
                ]
            )
        )  # fmt: skip
        f = fields("step-completed", wf, enc({**step_data(step), key: value}))
        optional = key in ("arguments", "recovery", "annotations", "completedAt")  # left out, noted
        repaired = optional and bool(STEP_RE.fullmatch(step))
    elif how == "step-bad-id":
        f = fields("step-completed", wf, enc(step_data(draw(bad_step_ids)), ascii_only=draw(st.booleans())))
    else:  # failed-wrong-type
        key, value = draw(
            st.sampled_from(
                [
                    ("stepsCompleted", -1), ("stepsCompleted", "3"), ("stepsCompleted", 100_001),
                    ("stepsCompleted", 1.5),
                    ("parallel", "yes"), ("onFailure", "maybe"), ("reason", ["x"]), ("failedStep", "x"),
                    ("reason", "r" * 8193), ("failedStep", {"tool": 1}), ("failedStep", {"error": "e" * 8193}),
                ]
            )
        )  # fmt: skip
        f = fields("workflow-failed", wf, enc({"reason": "x", key: value}))
        repaired = True  # every field of a failure is optional or a text: the unwind must start
    f.update(draw(extra_fields))
    if repaired:
        return Scenario(None, [Entry(f, "handled")])
    return Scenario(None, [Entry(f, "dead", reason=reason)])


@st.composite
def valid_entry(draw: st.DrawFn, wf: str) -> Scenario:
    """One entry that keeps to the contract, odd as it may look: it must be handled, not dead-lettered."""
    kind = draw(st.sampled_from(["step", "step", "step", "failed", "completed"]))
    extra = draw(extra_fields)
    if draw(st.booleans()):
        extra[b"v"] = b"1"
    if kind == "failed":
        announced = draw(st.sampled_from([None, 0, 3]))
        data = {"reason": draw(st.text(max_size=50)), "stepsCompleted": announced, "unknownKey": [1, {"a": None}]}
        f = fields("workflow-failed", wf, enc(data, ascii_only=draw(st.booleans())))
        final = frozenset({"failed"} if announced else {"compensated"})
        return Scenario(wf, [Entry({**f, **extra}, "handled")], final)
    if kind == "completed":
        f = fields("workflow-completed", wf, draw(st.sampled_from([b"{}", b' { "extra" : [ ] } ', b'{"a":{"b":1}}'])))
        return Scenario(wf, [Entry({**f, **extra}, "handled")], frozenset({"completed"}))
    step = draw(step_ids)
    recovery = draw(
        st.sampled_from(
            [
                RECOVERY,
                None,
                {"strategy": "retry"},
                {"strategy": "compensation"},
                {"strategy": "compensation", "compensatingOperation": {"operationId": "release", "parameters": {
                    "id": "$response.body#/missing"}}},
                {"strategy": "compensation", "compensatingOperation": {"operationId": "bad name"}},
                {"strategy": "compensation", "compensatingOperation": {"operationId": "reserve"}},
                {"strategy": "compensation", "compensatingOperation": {"operationId": "release", "parameters": {
                    "id": "$url"}}},
            ]
        )
    )  # fmt: skip
    data = step_data(step, recovery, tool=draw(st.sampled_from(["reserve", "résérve", "t" * 128, "工具"])))
    how = draw(st.sampled_from(["plain", "plain", "near-cap", "deep-ok", "unicode", "huge-extra", "text-result"]))
    if how == "near-cap":
        raw = pad_to(data, MAX_DATA_BYTES - draw(st.integers(0, 2048)))
    elif how == "deep-ok":
        depth = MAX_DEPTH - 3
        raw = splice({**data, "arguments": {"sku": "s", "x": "@@"}}, b"[" * depth + b"]" * depth)
    elif how == "huge-extra":  # a big field beside `data` is not data: ignored, not a reason to refuse
        raw = enc(data)
        extra[b"trace"] = b"t" * draw(st.integers(MAX_DATA_BYTES, 2 * MAX_DATA_BYTES))
    elif how == "text-result":  # no structuredContent: $response.body is the text, parsed as JSON when it is
        text = draw(
            st.sampled_from(
                ['{"id": "x"}', '{"id": NaN}', '{"id": "\\ud800"}', "[" * 5000 + "]" * 5000, "not json", ""]
            )
        )
        raw = enc({**data, "result": {"content": [{"type": "text", "text": text}]}})
    elif how == "unicode":
        raw = enc({**data, "arguments": {"sku": draw(st.text(max_size=30)), "n": "ünï"}}, ascii_only=False)
    else:
        raw = enc(data, ascii_only=draw(st.booleans()))
    return Scenario(
        wf,
        [Entry({**fields("step-completed", wf, raw), **extra}, "handled", step=(wf, step, True))],
        frozenset({"running"}),
    )


@st.composite
def semantic(draw: st.DrawFn, wf: str) -> Scenario:
    """Well-formed entries that make no sense in their order, and late ones that do."""
    a, b = draw(st.lists(step_ids, min_size=2, max_size=2, unique=True))
    sa = fields("step-completed", wf, enc(step_data(a)))
    sb = fields("step-completed", wf, enc(step_data(b)))
    failed = fields("workflow-failed", wf, enc({"reason": "boom"}))
    done = fields("workflow-completed", wf, b"{}")
    report = draw(st.sampled_from(REPORTS))
    op = draw(st.sampled_from(OPERATOR))

    def step(f: dict[bytes, bytes], name: str, first: bool = True) -> Entry:
        return Entry(f, "handled", step=(wf, name, first))

    def ok(f: dict[bytes, bytes]) -> Entry:
        return Entry(f, "handled")

    def dead(f: dict[bytes, bytes], reason: str | None = None) -> Entry:
        return Entry(f, "dead", reason=reason)

    which = draw(
        st.sampled_from(
            [
                "report-unknown-workflow", "operator-unknown-workflow", "completed-then-step", "completed-then-failed",
                "failed-then-completed", "report-unknown-step", "report-bad-dispatch", "operator-while-running",
                "operator-unknown-step", "late-step", "step-after-compensated", "failed-before-step",
            ]
        )
    )  # fmt: skip
    match which:
        case "report-unknown-workflow":
            return Scenario(None, [dead(fields(report, wf, enc(report_data(report, a))), "unknown workflow")])
        case "operator-unknown-workflow":
            data = enc({"step": a, "by": "fuzz"} if draw(st.booleans()) else {})
            return Scenario(None, [dead(fields(op, wf, data), "unknown workflow")])
        case "completed-then-step":
            return Scenario(wf, [step(sa, a), ok(done), step(sb, b), step(sa, a, False)], {"completed"})
        case "completed-then-failed":
            return Scenario(wf, [ok(done), dead(failed, "after the workflow completed")], {"completed"})
        case "failed-then-completed":
            return Scenario(wf, [step(sa, a), ok(failed), dead(done, "workflow-completed")], {"compensating"})
        case "report-unknown-step":
            ghost = fields(report, wf, enc(report_data(report, b)))
            return Scenario(wf, [step(sa, a), ok(failed), dead(ghost, "no compensation record")], {"compensating"})
        case "report-bad-dispatch":
            dispatch = draw(st.sampled_from([0, -1, 2, 99]))
            bad = fields(report, wf, enc(report_data(report, a, dispatch)))
            return Scenario(wf, [step(sa, a), ok(failed), dead(bad, "dispatch")], {"compensating"})
        case "operator-while-running":
            return Scenario(
                wf, [step(sa, a), dead(fields(op, wf, enc({"step": a})), "workflow is running")], {"running"}
            )
        case "operator-unknown-step":
            bad = fields(op, wf, enc({"step": b, "by": "fuzz"}))
            return Scenario(wf, [step(sa, a), ok(failed), dead(bad, "has no step")], {"compensating"})
        case "late-step":
            return Scenario(wf, [step(sa, a), ok(failed), step(sb, b)], {"compensating"})
        case "step-after-compensated":
            return Scenario(wf, [ok(failed), step(sa, a)], {"compensating"})
        case _:  # failed-before-step
            return Scenario(wf, [ok(failed)], {"compensated"})


@st.composite
def noise(draw: st.DrawFn, wf: str) -> Scenario:
    """Free-form entries: only the invariants are checked (dead-lettered or not, never a crash)."""
    if draw(st.booleans()):
        f = draw(
            st.dictionaries(
                st.sampled_from([b"type", b"workflow", b"data", b"v", b"dead.reason", b"dead.id"])
                | st.binary(max_size=8),
                st.one_of(
                    st.binary(max_size=64),
                    st.sampled_from(TYPES).map(str.encode),
                    st.just(wf.encode()),
                    json_values.map(enc),
                ),
                min_size=1,
                max_size=6,
            )
        )
    else:
        kind = draw(st.sampled_from(TYPES))
        keys = ["step", "server", "tool", "result", "arguments", "recovery", "reason", "stepsCompleted", "dispatch",
                "attempt", "final", "error", "status", "by", "note", "parallel", "onFailure", "failedStep"]  # fmt: skip
        data = draw(st.dictionaries(st.sampled_from(keys), json_values | step_ids, max_size=6))
        f = fields(kind, wf, enc(data, ascii_only=draw(st.booleans())))
    return Scenario(wf, [Entry(f, "either")], None)


@st.composite
def good_workflow(draw: st.DrawFn, wf: str) -> list[Scenario]:
    """The valid workflow, plus hostile satellites that must not disturb it in whatever order they land."""
    steps = draw(st.lists(step_ids, min_size=1, max_size=4, unique=True))
    entries = [Entry(fields("step-completed", wf, enc(step_data(s))), "handled", step=(wf, s, True)) for s in steps]
    announced = draw(st.sampled_from([None, len(steps)]))
    failed = fields("workflow-failed", wf, enc({"reason": "card declined", "stepsCompleted": announced}))
    entries.append(Entry(failed, "handled"))
    if draw(st.booleans()):
        entries.append(Entry(failed, "handled"))  # a duplicate publish: changes nothing
    scenarios = [Scenario(wf, entries, frozenset({"compensating"}), good=True, steps=steps)]
    ghost = draw(step_ids.filter(lambda s: s not in steps))
    for _ in range(draw(st.integers(0, 4))):
        report = draw(st.sampled_from(REPORTS))
        choice = draw(st.sampled_from(["ghost-report", "bad-dispatch", "ghost-operator", "dup-step"]))
        if choice == "ghost-report":
            entry = Entry(fields(report, wf, enc(report_data(report, ghost))), "dead")
        elif choice == "bad-dispatch":
            data = report_data(report, draw(st.sampled_from(steps)), draw(st.sampled_from([0, -1, 7, 99])))
            entry = Entry(fields(report, wf, enc(data)), "dead")
        elif choice == "ghost-operator":
            entry = Entry(fields(draw(st.sampled_from(OPERATOR)), wf, enc({"step": ghost})), "dead")
        else:
            s = draw(st.sampled_from(steps))
            entry = Entry(fields("step-completed", wf, enc(step_data(s))), "handled", step=(wf, s, False))
        scenarios.append(Scenario(None, [entry]))
    return scenarios


@st.composite
def batches(draw: st.DrawFn, tag: str, min_size: int, max_size: int) -> tuple[list[Scenario], list[Entry]]:
    """Scenarios on fresh workflows (`fz-<tag>-<i>`) and a good one, interleaved at random."""
    count = draw(st.integers(min_size, max_size))
    scenarios: list[Scenario] = []
    for i in range(count):
        wf = f"fz-{tag}-{i}"
        if draw(st.integers(0, 9)) == 0:  # now and then an id at the 200-character limit
            wf = (wf + "-" + "L" * 200)[:200]
        maker = draw(st.sampled_from([broken_entry, broken_entry, valid_entry, semantic, semantic, noise]))
        scenarios.append(draw(maker(wf)))
    scenarios += draw(good_workflow(draw(st.from_regex(rf"good@{tag}[A-Za-z0-9._:@-]{{0,30}}", fullmatch=True))))
    rng = draw(st.randoms(use_true_random=False))
    queues = [list(s.entries) for s in scenarios]
    merged: list[Entry] = []
    while live := [q for q in queues if q]:
        merged.append(rng.choice(live).pop(0))
    return scenarios, merged


# Checks ---------------------------------------------------------------------------------------


def publish(r: redis.Redis, entries: list[Entry]) -> list[bytes]:
    pipe = r.pipeline(transaction=False)
    for entry in entries:
        pipe.xadd(K.events, entry.fields)
    return pipe.execute()


def all_acknowledged(r: redis.Redis, last_id: bytes) -> bool:
    (group,) = r.xinfo_groups(K.events)
    return group["pending"] == 0 and group["last-delivered-id"] == last_id


def check_entries(r: redis.Redis, entries: list[Entry], ids: list[bytes]) -> None:
    """Every entry: dead-lettered with reason and original fields, or handled as the contract says."""
    dead = {}
    for _, record in r.xrange(K.dead_letter):
        assert record[b"dead.id"] not in dead, f"dead-lettered twice: {record[b'dead.id']!r}"
        dead[record[b"dead.id"]] = record
    for entry, entry_id in zip(entries, ids, strict=True):
        record = dead.get(entry_id)
        what = f"entry {entry_id!r} {entry.fields!r:.400}"
        if record is not None:
            reason = record[b"dead.reason"].decode()
            assert reason, what
            float(record[b"dead.at"])
            for key, value in entry.fields.items():
                if not key.startswith(b"dead."):  # our own names; the entry's are not copied over them
                    assert record.get(key) == value, f"{what}: field {key!r} not kept"
            assert entry.expect != "handled", f"{what} was dead-lettered: {reason}"
            assert entry.reason is None or entry.reason in reason, f"{what}: reason {reason!r}"
            continue
        assert entry.expect != "dead", f"{what} was neither dead-lettered nor should it have been handled"
        try:  # not dead-lettered, so the gate must accept it
            event = decode_entry(entry_id.decode(), entry.fields)
        except InvalidEvent as exc:
            raise AssertionError(f"{what} broke the contract ({exc}) but was not dead-lettered") from None
        if entry.step is not None:
            wf, step, first = entry.step
            assert r.hexists(K.comp(wf), step), f"{what}: step not recorded"
            if first:
                assert event.raw in r.lrange(K.steps(wf), 0, -1), f"{what}: step data not on the stack"


def check_workflows(r: redis.Redis, scenarios: list[Scenario]) -> None:
    """Each workflow's keys agree with one another, with the indexes and with the queue."""
    for key in r.scan_iter(match=f"{K.prefix}:{{*}}:state", count=1000):
        wf = key.decode()[len(K.prefix) + 2 : -len("}:state")]
        state = state_from_hash(r.hgetall(key))
        assert state.version >= 1 and state.status in STATUSES, wf
        comps = {k.decode(): comp_decoder.decode(v) for k, v in r.hgetall(K.comp(wf)).items()}
        assert state.steps == r.llen(K.steps(wf)) == len(comps), wf
        for status in STATUSES:
            member = r.zscore(K.index(status), wf) is not None
            assert member == (status == state.status), f"{wf}: index {status} (status {state.status})"
        for comp in comps.values():
            if comp.status in IN_FLIGHT:
                assert comp.idempotency_key is not None, f"{wf}/{comp.step}"
                job_id = comp.via or _job_id(comp.idempotency_key, comp.dispatch)  # its own, or its slip's
                assert Job.exists(job_id, connection=r), f"{wf}/{comp.step} in flight without a job"
        if state.status == "compensated":
            assert all(c.status in SETTLED and c.status != "unrecoverable" for c in comps.values()), wf
        if state.status == "running":
            assert not any(c.status in IN_FLIGHT for c in comps.values()), wf
    for status in STATUSES:  # nothing expires during a run, so no member may lack its workflow
        for member in r.zrange(K.index(status), 0, -1):
            assert r.exists(K.state(member.decode())), f"index {status} names {member!r}, which does not exist"
    for scenario in scenarios:
        if scenario.final is not None and scenario.workflow is not None:
            status = r.hget(K.state(scenario.workflow), "status")
            assert status is not None and status.decode() in scenario.final, (scenario.workflow, status)


def compensate_good(r: redis.Redis, scenario: Scenario, merged: list[Entry], settle: Callable[[], None]) -> None:
    """Play the worker for the valid workflow: report success for each job it queues, in turn."""
    wf = scenario.workflow
    # LIFO over the order the steps were first published in (a duplicate may have come first).
    order = [e.step[1] for e in merged if e.step is not None and e.step[0] == wf]
    expected = list(reversed(list(dict.fromkeys(order))))
    assert wf is not None and sorted(expected) == sorted(scenario.steps)
    done: list[str] = []
    for _ in range(3 * len(expected) + 3):
        if r.hget(K.state(wf), "status") != b"compensating":
            break
        comps = [comp_decoder.decode(v) for v in r.hgetall(K.comp(wf)).values()]
        heads = [c for c in comps if c.status == "queued" and not c.via]  # a routing slip rides behind one
        assert len(heads) <= 1, f"{wf}: one job in flight, not {[c.step for c in heads]}"
        slip = sorted((c for c in comps if c.status == "queued" and c.via), key=completion_order, reverse=True)
        assert len({c.via for c in slip}) <= 1, f"{wf}: one routing slip, not {[c.via for c in slip]}"
        comp = heads[0] if heads else slip[0]  # the slip's worker reports its steps in LIFO order
        report = {
            "step": comp.step,
            "dispatch": comp.dispatch,
            "attempt": 1,
            "final": True,
            "idempotencyKey": comp.idempotency_key,
            "result": {"structuredContent": {"released": True}},
        }
        r.xadd(K.events, fields("compensation-succeeded", wf, enc(report)))
        done.append(comp.step)
        settle()
    assert r.hget(K.state(wf), "status") == b"compensated", f"{wf}: {r.hgetall(K.state(wf))}"
    assert done == expected, f"{wf}: compensated {done}, expected LIFO {expected}"
    jobs = [job_decoder.decode(j.args[0]) for j in Queue(K.queue, connection=r).get_jobs()]
    mine = {one.step: one for j in jobs if j.workflow == wf for one in (j, *j.then)}
    assert sorted(mine) == sorted(expected)
    for step, job in mine.items():
        assert (job.operation_id, job.arguments, job.dispatch) == (
            "release",
            {"id": f"r-{step}", "sku": f"sku-{step}", "note": f"undo r-{step}"},
            1,
        )


def _job_id(key: str, dispatch: int) -> str:
    job = CompensationJob(
        workflow="", step="", server="", tool="", operation_id="", arguments={}, idempotency_key=key, dispatch=dispatch
    )
    return job.job_id


def run_example(r: redis.Redis, scenarios: list[Scenario], merged: list[Entry], settle: Callable[[], None]) -> None:
    ids = publish(r, merged)
    settle()
    check_entries(r, merged, ids)
    check_workflows(r, scenarios)
    for scenario in scenarios:
        if scenario.good:
            compensate_good(r, scenario, merged, settle)
    check_workflows(r, [])


# The tests ------------------------------------------------------------------------------------


def fuzz(max_examples: int) -> settings:
    """Slow examples by design (each drives a coordinator), so no deadline; no example database either."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


@fuzz(60)
@given(data=st.data(), batch=st.sampled_from([1, 7, 100]))
def test_hostile_entries_in_process(redis_url: str, data: st.DataObject, batch: int) -> None:
    """Many examples against `Coordinator.step` on the real server: fast, and a failure shrinks."""
    scenarios, merged = data.draw(batches("p", 5, 25))
    r = redis.Redis.from_url(redis_url)
    try:
        r.flushdb()
        coord = Coordinator(r, parse_config({"coordinator": {"block_ms": 1, "batch": batch}}), name="fuzz")
        coord.ensure_group()

        def settle() -> None:
            for _ in range(10_000):
                if not coord.step().events:
                    break
            last = r.xinfo_stream(K.events)["last-generated-id"]
            assert all_acknowledged(r, last)

        run_example(r, scenarios, merged, settle)
    finally:
        r.flushdb()
        r.close()


def test_hostile_entries_against_a_coordinator_process(redis_url: str, tmp_path: Path) -> None:
    """A real `saga coordinator` fed a few hundred hostile entries stays up and exits 0 on SIGTERM."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    config = tmp_path / "saga.toml"
    write_config(Config(coordinator=CoordinatorSettings(block_ms=20)), config)
    log = tmp_path / "coordinator.log"
    proc = saga_process("coordinator", "--name", "fuzzed", redis_url=redis_url, config=config, log=log)
    published = [0]
    try:
        # Joined the group (and so past installing its signal handlers) before anything is sent.
        wait_for(lambda: _consumers(r) == {"fuzzed"}, 30, "the coordinator to join the group")
        examples = [0]

        @fuzz(8)
        @given(data=st.data())
        def feed(data: st.DataObject) -> None:
            examples[0] += 1
            scenarios, merged = data.draw(batches(f"x{examples[0]}", 40, 60))
            published[0] += len(merged)

            def settle() -> None:
                last = r.xinfo_stream(K.events)["last-generated-id"]
                wait_for(lambda: all_acknowledged(r, last), 30, "every entry acknowledged")
                assert proc.poll() is None, log.read_text()[-3000:]

            run_example(r, scenarios, merged, settle)

        feed()
        assert published[0] >= 300, published[0]
        assert proc.poll() is None
    finally:
        code = stop(proc)
        text = log.read_text()
        r.flushdb()
        r.close()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def _consumers(r: redis.Redis) -> set[str]:
    try:
        return {c["name"].decode() for c in r.xinfo_consumers(K.events, K.group)}
    except redis.ResponseError:
        return set()


@pytest.mark.parametrize("depth", [MAX_DEPTH - 3, MAX_DEPTH + 1, 985, 990, 995])
def test_depth_near_any_limit_never_crashes_the_coordinator(r: redis.Redis, depth: int) -> None:
    """Regression: nesting just inside msgspec's guard passed the gate, then blew the stack on commit."""
    coord = Coordinator(r, parse_config({"coordinator": {"block_ms": 1}}), name="deep")
    coord.ensure_group()
    deep = b"[" * depth + b"]" * depth
    data = step_data("a", {**RECOVERY, "compensatingOperation": {"operationId": "release", "parameters": {
        "x": "$request.body#/x", "t": "v {$request.body#/x}"}}}, arguments={"x": "@@"})  # fmt: skip
    r.xadd(K.events, fields("step-completed", "deep", splice(data, deep)))
    r.xadd(K.events, fields("workflow-failed", "deep", b"{}"))
    while coord.step().events:
        pass
    assert r.xpending(K.events, K.group)["pending"] == 0
    dead = [f[b"dead.reason"].decode() for _, f in r.xrange(K.dead_letter)]
    if depth + 2 > MAX_DEPTH:  # data is level 1, arguments level 2
        assert len(dead) == 1 and ("nested deeper" in dead[0] or "recursion" in dead[0])
    else:
        assert dead == [] and r.hget(K.state("deep"), "status") == b"compensating"


def test_many_records_in_one_transition(r: redis.Redis) -> None:
    """Regression: a parallel unwind of ~5000 steps overflowed Lua's unpack() in the commit script."""
    coord = Coordinator(r, parse_config({"coordinator": {"block_ms": 1, "batch": 10_000}}), name="wide")
    coord.ensure_group()
    pipe = r.pipeline(transaction=False)
    for i in range(5000):
        pipe.xadd(K.events, fields("step-completed", "wide", enc(step_data(f"s{i}"))))
    pipe.xadd(K.events, fields("workflow-failed", "wide", enc({"parallel": True})))
    pipe.execute()
    started = time.monotonic()
    while coord.step().events:
        assert time.monotonic() - started < 60
    assert r.xpending(K.events, K.group)["pending"] == 0
    comps = [msgspec.json.decode(v)["status"] for v in r.hvals(K.comp("wide"))]
    assert len(comps) == 5000 and set(comps) == {"queued"}
