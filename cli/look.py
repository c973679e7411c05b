"""Looking at workflows and at the service: inspect, list, watch, stats, dead-letters.

Each command fetches through `mcp_saga.runtime.reader` (the one reader of a workflow's keys), gets
typed snapshots back, and renders them as tables or as JSON; nothing here writes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import msgspec
from mcp_saga.cli import render
from mcp_saga.cli.args import CliError, Ops, add_command, config_of, positive, with_redis
from mcp_saga.runtime import operators
from mcp_saga.runtime.connect import node_of
from mcp_saga.runtime.reader import WorkflowSnapshot, state_fields
from mcp_saga.runtime.redis_checks import inspect_redis
from mcp_saga.schemas.keys import STATUSES, key_slot
from mcp_saga.schemas.records import UNWINDING, Compensation, WorkflowState
from mcp_saga.schemas.results import result_summary
from mcp_saga.schemas.timeline import Outcome, TimelineEntry


def load_workflow(ops: Ops, workflow: str) -> tuple[WorkflowState, dict[str, Compensation]]:
    try:
        operators.check_ids(workflow)
    except operators.CommandRefused as exc:
        raise CliError(str(exc)) from None
    loaded = ops.reader.records(workflow)
    if loaded is None:
        raise CliError(f"no workflow {workflow!r} (never seen by a coordinator, or expired)")
    return loaded


def cmd_inspect(ops: Ops) -> int:
    workflow = ops.args.workflow
    load_workflow(ops, workflow)  # the id check and "no workflow" message
    snapshot = ops.reader.snapshot(workflow, last=ops.args.last)
    if snapshot is None:
        raise CliError(f"workflow {workflow!r} expired just now")
    where = placement(ops, workflow)
    if ops.args.json:
        render.emit_json({**snapshot_json(snapshot), "where": where})
    else:
        render_snapshot(snapshot, ops.args.last)
        rows = [(k, where[k]) for k in ("slot", "node", "partition", "stream")] + [("keys", " ".join(where["keys"]))]
        render.console().print(render.pairs("where its keys live", rows))
    return 0


def placement(ops: Ops, workflow: str) -> dict[str, Any]:
    """Where a workflow's keys live: its slot (CLUSTER KEYSLOT of the id), the node, its partition's stream."""
    keys = ops.keys.route(workflow)
    return {
        "slot": key_slot(workflow),
        "node": node_of(ops.r, keys.state(workflow)) or "(a single Redis: all of it)",
        "partition": keys.part,
        "stream": keys.events,
        "keys": [*keys.workflow_keys(workflow)[:4]],
    }


def snapshot_json(snapshot: WorkflowSnapshot) -> dict[str, Any]:
    return {
        "workflow": snapshot.workflow,
        "state": state_fields(snapshot.state),
        "expiresIn": snapshot.expires_in,
        "steps": snapshot.steps,
        "compensations": [msgspec.to_builtins(c) for c in snapshot.compensations.values()],
        "timeline": [e.to_json() for e in snapshot.timeline],
    }


def render_snapshot(snapshot: WorkflowSnapshot, last: int | None) -> None:
    out = render.console()
    out.print(render.pairs(f"workflow {snapshot.workflow}", _state_rows(snapshot)))
    columns = "#, step, server, tool, result, undo, completed"
    out.print(
        render.table(
            "step stack (in the order the calls started, when announced; else completed)",
            columns,
            [_step_row(n, s) for n, s in enumerate(snapshot.steps)],
        )
    )
    columns = "#, step, status, server, operation, source, attempts, dispatch, key, error / reason, flags"
    out.print(
        render.table(
            "compensations (unwound from the bottom up)",
            columns,
            [_comp_row(c) for c in snapshot.compensations.values()],
        )
    )
    title = "timeline" + (f" (last {last})" if last else "")
    out.print(render.table(title, "time, type, step, detail", [_timeline_row(e) for e in snapshot.timeline]))


def _state_rows(snapshot: WorkflowSnapshot) -> list[tuple[str, Any]]:
    state, ttl = snapshot.state, snapshot.expires_in
    announced = f", {state.expected_steps} announced" if state.expected_steps else ""
    unwinding = ("parallel" if state.parallel else "one at a time") + f", on failure: {state.on_failure}"
    return [
        ("status", state.status),
        ("reason", state.reason),
        ("failed tool", state.failed_tool),
        ("attention", state.attention),
        ("steps", f"{state.steps} recorded{announced}"),
        ("unwinding", unwinding if state.status in UNWINDING else ""),
        ("barrier until", render.when(state.barrier_deadline)),
        ("barrier expired", "yes" if state.barrier_expired else ""),
        ("created", render.when(state.created_at)),
        ("updated", render.when(state.updated_at)),
        ("version", state.version),
        ("expires in", f"{ttl / 3600:.1f} h" if ttl is not None else ""),
    ]


def _step_row(n: int, step: Any) -> tuple[Any, ...]:
    if not isinstance(step, dict):
        return (n, "?", "", "", render.text(step, 60), "", "")
    recovery = step.get("recovery")
    operation = recovery.get("compensatingOperation") if isinstance(recovery, dict) else None
    completed = step.get("completedAt")
    if "result" in step:
        result = render.text(result_summary(step.get("result")), 60)
    else:  # an intent no answer settled: the call may or may not have taken effect
        result, completed = "no answer recorded (announced)", f"started {step.get('startedAt') or ''}".strip()
    return (
        n,
        step.get("step"),
        step.get("server"),
        step.get("tool"),
        result,
        operation.get("operationId") if isinstance(operation, dict) else "",
        render.when(completed) if isinstance(completed, int | float) else completed,
    )


def _comp_row(c: Compensation) -> tuple[Any, ...]:
    marks = (
        ("late", c.late),
        ("approved", c.approved),
        ("in doubt", c.in_doubt),
        ("recall", c.kind == "recall"),
        ("awaits live declaration", c.kind == "declaration"),
    )
    flags = " ".join(flag for flag, on in marks if on)
    return (
        c.seq,
        c.step,
        c.status,
        c.server,
        c.operation_id,
        c.source,
        c.attempts,
        c.dispatch,
        c.idempotency_key,
        c.last_error or c.reason,
        flags,
    )


def _timeline_row(entry: TimelineEntry) -> tuple[Any, ...]:
    detail = " ".join(f"{k}={v}" for k, v in entry.details().items())
    return (render.when(entry.at or None), entry.type, entry.step, detail)


def cmd_list(ops: Ops) -> int:
    limit = ops.args.limit
    rows = [
        {
            "workflow": workflow,
            "status": state.status,
            "steps": state.steps,
            "updatedAt": state.updated_at,
            "attention": state.attention,
        }
        for workflow, state in ops.reader.recent(ops.args.status, limit)
    ]
    if ops.args.json:
        render.emit_json(rows)
        return 0
    title = f"workflows ({ops.args.status or 'any status'}, newest first, at most {limit})"
    columns = "workflow, status, steps, updated, attention"
    cells = [(w["workflow"], w["status"], w["steps"], render.when(w["updatedAt"]), w["attention"]) for w in rows]
    render.console().print(render.table(title, columns, cells))
    return 0


def cmd_watch(ops: Ops) -> int:
    last: dict[str, str] = {}
    for part in ops.keys.every():
        if ops.args.from_start:
            last[part.outcomes] = "0-0"
        else:  # the current end as an id, so nothing published between two reads is missed (as with `$`)
            newest = ops.r.xrevrange(part.outcomes, count=1)
            last[part.outcomes] = newest[0][0].decode() if newest else "0-0"
    # Short blocks: redis-py's default socket timeout (5 s) would cut a longer one off. One XREAD
    # per partition in turn, as streams in different cluster slots cannot share one.
    block = max(50, 1000 // len(last))
    seen = 0
    try:
        while True:
            for stream, after in list(last.items()):
                for entry_id, fields in _entries(ops.r.xread({stream: after}, count=100, block=block)):
                    last[stream] = entry_id.decode()
                    outcome = Outcome.from_fields(fields)
                    if ops.args.json:
                        print(json.dumps({"id": last[stream], **outcome.to_fields()}), flush=True)
                    else:
                        rest = " ".join(
                            f"{k}={v}" for k, v in outcome.to_fields().items() if k not in ("at", "type", "workflow")
                        )
                        head = f"{render.when(outcome.at or None)}  {outcome.type:<24} {outcome.workflow or '?'}"
                        print(f"{head}  {rest}".rstrip(), flush=True)
                    seen += 1
                    if ops.args.count and seen >= ops.args.count:
                        return 0
    except KeyboardInterrupt:
        return 0


def _entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return [entry for _, entries in reply or () for entry in entries]


def cmd_stats(ops: Ops) -> int:
    keys = ops.keys
    counts = ops.reader.counts()
    pipe = ops.r.pipeline(transaction=False)
    for part in keys.every():
        for stream in (part.events, part.outcomes, part.dead_letter):
            pipe.xlen(stream)
    lengths = pipe.execute()
    events, outcomes, dead = sum(lengths[0::3]), sum(lengths[1::3]), sum(lengths[2::3])
    groups = [
        {
            "name": render.text(g["name"]),
            "partition": g["partition"],
            "stream": g["stream"],
            "consumers": g["consumers"],
            "pending": g["pending"],
            "lag": g.get("lag"),
            "lastDelivered": render.text(g["last-delivered-id"]),
        }
        for g in ops.reader.groups()
    ]
    partitions = [
        {
            **msgspec.to_builtins(p),
            "node": node_of(ops.r, p.stream),
            "outcomes": lengths[3 * p.partition + 1],
            "deadLetters": lengths[3 * p.partition + 2],
        }
        for p in ops.reader.partitions(lengths[0::3])
    ]
    depth = ops.reader.queue_depth()  # what the fleet gauges of runtime/metrics.py read too
    facts = inspect_redis(ops.r)
    stats = {
        "redis": msgspec.to_builtins(facts),
        "cluster": ops.config.redis.cluster,
        "workflows": counts,
        "queue": {"name": keys.queue, **depth},
        "events": {"length": events, "groups": groups},
        "outcomes": outcomes,
        "deadLetters": dead,
        "partitions": partitions,
    }
    if ops.args.json:
        render.emit_json(stats)
        return 0
    out = render.console()
    unknown = "unknown (CONFIG disabled)"
    redis_rows = [("eviction policy", facts.eviction_policy or unknown), ("persistence", facts.persistence or unknown)]
    out.print(render.pairs("redis", redis_rows, skip_empty=False))
    out.print(render.pairs("workflows by status", stats["workflows"].items(), skip_empty=False))
    out.print(render.pairs(f"RQ queue {keys.queue!r}", depth.items(), skip_empty=False))
    if keys.partitions == 1:
        only = keys.on(0)
        rows = [(only.events, events), (only.outcomes, outcomes), (only.dead_letter, dead)]
        out.print(render.pairs("streams", rows, skip_empty=False))
    else:
        rows = [("events", events), ("outcomes", outcomes), ("dead letters", dead)]
        out.print(render.pairs(f"streams (sum of {keys.partitions} partitions)", rows, skip_empty=False))
    columns = "partition, events stream, slot, node, events, pending, lag, outcomes, dead letters, read by"
    cells = [
        (
            p["partition"],
            p["stream"],
            p["slot"],
            p["node"] or "",
            p["length"],
            p["pending"],
            p["lag"],
            p["outcomes"],
            p["deadLetters"],
            " ".join(f"{c['name']} ({c['pending']} pending)" for c in p["coordinators"]) or "nobody",
        )
        for p in partitions
    ]
    out.print(render.table("partitions: where each lives and which coordinators read it", columns, cells))
    if groups:
        columns = "group, partition, consumers, pending, lag, last delivered"
        rows = [(g["name"], g["partition"], g["consumers"], g["pending"], g["lag"], g["lastDelivered"]) for g in groups]
        out.print(render.table("consumer groups", columns, rows))
    else:
        out.print("no consumer group on any events stream: no coordinator has started", markup=False)
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    """Where a workflow's events go, from the config alone (no Redis needed): what any publisher computes."""
    workflow = args.workflow
    try:
        operators.check_ids(workflow)
    except operators.CommandRefused as exc:
        raise CliError(str(exc)) from None
    keys = config_of(args).keys().route(workflow)
    found = {
        "workflow": workflow,
        "slot": key_slot(workflow),
        "partitions": keys.partitions,
        "partition": keys.part,
        "events": keys.events,
        "outcomes": keys.outcomes,
        "deadLetter": keys.dead_letter,
        "keys": [*keys.workflow_keys(workflow)[:4]],
    }
    if args.json:
        render.emit_json(found)
    else:
        rows = [(k, v if not isinstance(v, list) else " ".join(v)) for k, v in found.items()]
        render.console().print(render.pairs(f"workflow {workflow}", rows))
    return 0


def cmd_dead_letters(ops: Ops) -> int:
    entries = [
        {"id": d.id, "at": d.at, "reason": d.reason, "originalId": d.original_id, "fields": d.fields}
        for d in ops.reader.dead_letters(ops.args.limit)
    ]
    if ops.args.json:
        render.emit_json(entries)
        return 0
    render.console().print(
        render.table(
            f"dead letters of every partition (newest first, at most {ops.args.limit})",
            "dead-lettered, original id, type, workflow, reason, data",
            [
                (
                    render.when(e["at"]),
                    e["originalId"],
                    e["fields"].get("type"),
                    e["fields"].get("workflow"),
                    e["reason"],
                    render.text(e["fields"].get("data"), 80),
                )
                for e in entries
            ],
        )
    )
    return 0


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = add_command(
        sub, common, "inspect", with_redis(cmd_inspect), "a workflow's state, step stack, compensations and timeline"
    )
    p.add_argument("workflow")
    p.add_argument("--last", type=positive, metavar="N", help="show only the last N timeline entries")

    p = add_command(sub, common, "list", with_redis(cmd_list), "workflows by status, newest first")
    p.add_argument("--status", choices=STATUSES)
    p.add_argument("--limit", type=positive, default=50, metavar="N", help="at most N workflows (default 50)")

    help = "follow workflow and compensation outcomes (Ctrl-C to stop)"
    p = add_command(sub, common, "watch", with_redis(cmd_watch), help)
    p.add_argument("--from-start", action="store_true", help="print the outcomes already recorded first")
    p.add_argument("--count", type=positive, metavar="N", help="exit after N outcomes")

    add_command(
        sub, common, "stats", with_redis(cmd_stats), "workflows by status, queue depth, streams and consumer lag"
    )

    help = "which partition, events stream and slot a workflow id maps to (CLUSTER KEYSLOT id mod partitions)"
    p = sub.add_parser("partition", help=help, description=help)
    common(p)
    p.add_argument("workflow")
    p.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
    p.set_defaults(run=cmd_partition)

    help = "recent events the coordinator could not use, and why"
    p = add_command(sub, common, "dead-letters", with_redis(cmd_dead_letters), help)
    p.add_argument("--limit", type=positive, default=20, metavar="N", help="at most N entries (default 20)")
