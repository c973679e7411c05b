"""What each page shows, built from Reader results: plain dicts and lists, no I/O, no markup.

Templates only lay these out; everything untrusted (tool results, errors, notes) stays text here
and is escaped by Jinja's autoescaping when it is rendered.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import msgspec
from mcp_saga.runtime.reader import Fleet, WorkflowSnapshot
from mcp_saga.schemas.operators import COMMANDS, operator_refusal
from mcp_saga.schemas.records import UNWINDING, Compensation, WorkflowState
from mcp_saga.schemas.results import result_summary
from mcp_saga.schemas.timeline import DeadLetter, TimelineEntry

# Timeline entries that end one compensation attempt (the worker's report, with its duration).
ATTEMPT_ENDS = {
    "compensation-succeeded": "succeeded",
    "compensation-failed": "failed",
    "compensation-attempt-failed": "retrying",
    "compensation-refused": "refused",
}
WIDTH, LABEL, LANE = 1200, 150, 34


def when(ts: float | str | None) -> str:
    seconds = _seconds(ts)
    if seconds is None:
        return ""
    return datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return ""
    delta = max(0.0, (now or time.time()) - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if delta >= size:
            return f"{delta / size:.0f} {unit} ago"
    return f"{delta:.0f} s ago"


def pretty(value: Any) -> str:
    if value is None:
        return ""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def workflow_row(workflow: str, state: WorkflowState) -> dict[str, Any]:
    return {
        "id": workflow,
        "status": state.status,
        "steps": state.steps,
        "reason": state.reason,
        "attention": state.attention,
        "updated": when(state.updated_at),
        "ago": ago(state.updated_at),
        "actionable": state.status in UNWINDING,
    }


def compensation(comp: Compensation, state: WorkflowState) -> dict[str, Any]:
    allowed = [c for c in COMMANDS if state.status in UNWINDING and operator_refusal(c, comp) is None]
    return {
        "step": comp.step,
        "server": comp.server,
        "tool": comp.tool,
        "status": comp.status,
        "operation": comp.operation_id,
        "arguments": pretty(comp.arguments),
        "key": comp.idempotency_key,
        "attempts": comp.attempts,
        "dispatch": comp.dispatch,
        "last_error": comp.last_error,
        "reason": comp.reason,
        "source": comp.source,
        "approved": comp.approved,
        "late": comp.late,
        "updated": when(comp.updated_at),
        "actions": allowed,
    }


def workflow_page(snapshot: WorkflowSnapshot) -> dict[str, Any]:
    state = snapshot.state
    comps = snapshot.compensations
    steps = [
        {
            "step": s.get("step"),
            "server": s.get("server"),
            "tool": s.get("tool"),
            "arguments": pretty(s.get("arguments")),
            "result": _cut(result_summary(s.get("result")), 400),
            "completed": when(s.get("completedAt")) or str(s.get("completedAt") or ""),
        }
        if isinstance(s, dict)
        else {"step": None, "server": None, "tool": None, "arguments": "", "result": str(s), "completed": ""}
        for s in snapshot.steps
    ]
    return {
        "id": snapshot.workflow,
        "state": {
            "status": state.status,
            "reason": state.reason,
            "failed_tool": state.failed_tool,
            "attention": state.attention,
            "steps": state.steps,
            "expected_steps": state.expected_steps,
            "mode": ("parallel" if state.parallel else "one at a time") + f", on failure: {state.on_failure}",
            "created": when(state.created_at),
            "updated": when(state.updated_at),
            "version": state.version,
            "expires_in": f"{snapshot.expires_in / 3600:.1f} h" if snapshot.expires_in is not None else "",
        },
        "actionable": state.status in UNWINDING,
        "steps": steps,
        # The unwinding order: newest step first.
        "compensations": [compensation(c, state) for c in reversed(comps.values())],
        "timeline": timeline_rows(snapshot.timeline),
        "picture": picture(snapshot),
    }


def timeline_rows(entries: list[TimelineEntry]) -> list[dict[str, Any]]:
    start = entries[0].at or None if entries else None
    rows = []
    for entry in entries:
        at = entry.at or None
        rest = {k: v for k, v in entry.details().items() if k not in ("by", "workflow")}
        rows.append(
            {
                "id": entry.id,
                "offset": f"+{(at - start) * 1000:,.0f} ms" if at is not None and start is not None else "",
                "when": when(at),
                "type": entry.type,
                "step": entry.step or "",
                "by": entry.by or "",
                "detail": ", ".join(f"{k}={_cut(v, 300)}" for k, v in rest.items()),
            }
        )
    return rows


def picture(snapshot: WorkflowSnapshot) -> dict[str, Any]:
    """Geometry for the SVG timeline: one lane for the workflow (its steps, the failure, status changes), one per
    compensation.

    A compensation attempt is a bar ending at its report and as long as the worker measured it;
    dispatches and operator commands are marks on their step's lane.
    """
    # (time, kind, tooltip, text drawn beside the mark)
    forward: list[tuple[float, str, str, str]] = []
    for s in snapshot.steps:
        at = _seconds(s.get("completedAt")) if isinstance(s, dict) else None
        if at is not None:
            forward.append((at, "step", f"{s.get('step')}: {s.get('server')}:{s.get('tool')} completed", ""))
    lanes: dict[str, list[dict[str, Any]]] = {step: [] for step in reversed(snapshot.compensations)}
    times = [t for t, *_ in forward]
    for entry in snapshot.timeline:
        at = entry.at or None
        if at is None:
            continue
        times.append(at)
        kind, step = entry.type, entry.step
        if kind == "workflow-failed":
            forward.append((at, "failure", f"workflow failed: {entry.reason or ''}", "failed"))
            continue
        if step is None or step not in lanes:
            detail = entry.status or entry.by or entry.reason or ""
            forward.append((at, kind, f"{kind}: {detail}" if detail else kind, ""))
            continue
        if kind in ATTEMPT_ENDS:
            duration = entry.duration_ms
            start = at - duration / 1000 if duration is not None else at
            times.append(start)
            label = f"{step} attempt {entry.attempt if entry.attempt is not None else '?'}: {ATTEMPT_ENDS[kind]}"
            label += f" after {duration:,.0f} ms" if duration is not None else ""
            if entry.error or entry.reason:
                label += f": {_cut(entry.error or entry.reason or '', 200)}"
            short = f"{duration:,.0f} ms" if duration is not None else ATTEMPT_ENDS[kind]
            lanes[step].append({"start": start, "end": at, "kind": ATTEMPT_ENDS[kind], "label": label, "short": short})
        else:
            who = f" by {entry.by}" if entry.by else ""
            short = f"{kind.removeprefix('operator-')}{who}" if kind.startswith("operator-") else ""
            lanes[step].append({"start": at, "end": None, "kind": kind, "label": f"{kind}{who}", "short": short})
    if not times:
        return {"width": WIDTH, "height": LANE * 2, "lanes": [], "ticks": [], "label": LABEL}
    t0, t1 = min(times), max(times)
    span = max(t1 - t0, 0.001)

    def x(t: float) -> float:
        return round(LABEL + (t - t0) / span * (WIDTH - LABEL - 90), 1)

    def item(start: float, end: float | None, kind: str, label: str, short: str) -> dict[str, Any]:
        left = x(start)
        width = max(3.0, x(end) - left) if end is not None else 0
        return {"x": left, "w": width, "kind": kind, "label": label, "short": short}

    drawn = [
        {
            "name": "workflow",
            "status": None,
            # The failure last, so a status change at about the same instant does not cover it.
            "parts": [item(t, None, *rest) for t, *rest in sorted(forward, key=lambda f: (f[1] == "failure", f[0]))],
        }
    ]
    drawn += [
        {
            "name": f"undo {step}",
            "status": snapshot.compensations[step].status,
            # Operator marks last, so a dispatch at the same instant does not hide who acted.
            "parts": [
                item(i["start"], i["end"], i["kind"], i["label"], i["short"])
                for i in sorted(items, key=lambda i: i["kind"].startswith("operator-"))
            ],
        }
        for step, items in lanes.items()
    ]
    for n, lane in enumerate(drawn):
        lane["y"] = 20 + n * LANE
    # Offsets from the first timeline entry, as in the table of entries (forward steps come before it).
    origin = snapshot.timeline[0].at or None if snapshot.timeline else None
    origin = t0 if origin is None else origin
    ticks = [{"x": x(t0 + span * f), "label": _span(t0 + span * f - origin)} for f in (0, 0.25, 0.5, 0.75, 1)]
    return {"width": WIDTH, "height": 30 + len(drawn) * LANE, "lanes": drawn, "ticks": ticks, "label": LABEL}


def dead_letter(letter: DeadLetter) -> dict[str, Any]:
    return {
        "id": letter.id,
        "when": when(letter.at),
        "reason": letter.reason,
        "original_id": letter.original_id,
        "type": letter.fields.get("type", ""),
        "workflow": letter.fields.get("workflow", ""),
        "data": _cut(letter.fields.get("data", ""), 600),
    }


def fleet(f: Fleet, now: float | None = None) -> dict[str, Any]:
    data = msgspec.to_builtins(f)
    for worker in data["workers"]:
        worker["heartbeat"] = ago(worker["last_heartbeat"], now)
    return data


def _seconds(ts: float | str | None) -> float | None:
    """Epoch seconds from a float, a numeric string or an ISO-8601 text (as `completedAt` may be)."""
    if ts is None or ts == "":
        return None
    if isinstance(ts, int | float):
        return float(ts)
    try:
        return float(ts)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _span(seconds: float) -> str:
    sign = "-" if seconds < 0 else "+"
    seconds = abs(seconds)
    return f"{sign}{seconds * 1000:,.0f} ms" if seconds < 10 else f"{sign}{seconds:,.1f} s"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
