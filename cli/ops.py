"""Operator commands: look at workflows, follow outcomes, act on stuck compensations, check servers.

Everything here reads Redis; nothing writes workflow state. An action (`retry`, `resolve`, `skip`,
`approve`) is checked against the current records so that a pointless one is refused with the
reason up front, then sent as an operator event on `saga:events`: the coordinator stays the only
writer, applies it like any other event, and the workflow's timeline records who did what.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
from mcp_saga.cli import render
from mcp_saga.cli.args import CliError, config_of, redis_url
from mcp_saga.runtime import operators
from mcp_saga.runtime.reader import Reader, decode_fields, state_fields
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import UNWINDING, Compensation, WorkflowState
from mcp_saga.schemas.results import result_text
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


@dataclass(frozen=True, slots=True)
class Ops:
    args: argparse.Namespace
    r: redis.Redis
    keys: Keys
    config: Config

    @property
    def reader(self) -> Reader:
        return Reader(self.r, self.keys)


def _with_redis(fn: Callable[[Ops], int]) -> Callable[[argparse.Namespace], int]:
    """Give a command its Redis client, and turn an unreachable Redis into one line instead of a traceback."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        config = config_of(args)
        client = redis.Redis.from_url(redis_url(args))
        try:
            return fn(Ops(args, client, Keys(config.prefix), config))
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise CliError(f"cannot reach Redis: {exc}") from None
        finally:
            client.close()

    return run


# Reading a workflow ------------------------------------------------------------------------


def load_workflow(ops: Ops, workflow: str) -> tuple[WorkflowState, dict[str, Compensation]]:
    try:
        operators.check_workflow_id(workflow)
    except operators.CommandRefused as exc:
        raise CliError(str(exc)) from None
    loaded = ops.reader.records(workflow)
    if loaded is None:
        raise CliError(f"no workflow {workflow!r} (never seen by a coordinator, or expired)")
    return loaded


def _result_summary(result: Any) -> str:
    """The part of a CallToolResult a person looks for: its structured body, else its text."""
    if not isinstance(result, dict):
        return render.text(result, 60)
    body = result.get("structuredContent")
    if body is None:
        body = result_text(result)
    return ("error: " if result.get("isError") else "") + render.text(body, 60)


def cmd_inspect(ops: Ops) -> int:
    workflow = ops.args.workflow
    load_workflow(ops, workflow)  # the id check and "no workflow" message
    snapshot = ops.reader.snapshot(workflow, last=ops.args.last)
    if snapshot is None:
        raise CliError(f"workflow {workflow!r} expired just now")
    state, comps, steps, log, ttl = (
        snapshot.state,
        snapshot.compensations,
        snapshot.steps,
        snapshot.timeline,
        snapshot.expires_in,
    )
    if ops.args.json:
        render.emit_json(
            {
                "workflow": workflow,
                "state": state_fields(state),
                "expiresIn": ttl,
                "steps": steps,
                "compensations": [msgspec.to_builtins(c) for c in comps.values()],
                "timeline": log,
            }
        )
        return 0

    out = render.console()
    out.print(
        render.pairs(
            f"workflow {workflow}",
            [
                ("status", state.status),
                ("reason", state.reason),
                ("failed tool", state.failed_tool),
                ("attention", state.attention),
                (
                    "steps",
                    f"{state.steps} recorded" + (f", {state.expected_steps} announced" if state.expected_steps else ""),
                ),
                (
                    "unwinding",
                    ("parallel" if state.parallel else "one at a time") + f", on failure: {state.on_failure}"
                    if state.status in UNWINDING
                    else "",
                ),
                ("barrier until", render.when(state.barrier_deadline)),
                ("barrier expired", "yes" if state.barrier_expired else ""),
                ("created", render.when(state.created_at)),
                ("updated", render.when(state.updated_at)),
                ("version", state.version),
                ("expires in", f"{ttl / 3600:.1f} h" if ttl is not None else ""),
            ],
        )
    )
    rows = []
    for n, step in enumerate(steps):
        if not isinstance(step, dict):
            rows.append((n, "?", "", "", render.text(step, 60), "", ""))
            continue
        recovery = step.get("recovery")
        operation = recovery.get("compensatingOperation") if isinstance(recovery, dict) else None
        completed = step.get("completedAt")
        rows.append(
            (
                n,
                step.get("step"),
                step.get("server"),
                step.get("tool"),
                _result_summary(step.get("result")),
                operation.get("operationId") if isinstance(operation, dict) else "",
                render.when(completed) if isinstance(completed, int | float) else completed,
            )
        )
    out.print(render.table("step stack (completion order)", "#, step, server, tool, result, undo, completed", rows))
    out.print(
        render.table(
            "compensations (unwound from the bottom up)",
            "#, step, status, server, operation, source, attempts, dispatch, key, error / reason, flags",
            [
                (
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
                    " ".join(flag for flag, on in (("late", c.late), ("approved", c.approved)) if on),
                )
                for c in comps.values()
            ],
        )
    )
    out.print(
        render.table(
            "timeline" + (f" (last {ops.args.last})" if ops.args.last else ""),
            "time, type, step, detail",
            [
                (
                    render.when(e.get("at")),
                    e.get("type"),
                    e.get("step"),
                    " ".join(f"{k}={v}" for k, v in e.items() if k not in ("id", "at", "type", "step")),
                )
                for e in log
            ],
        )
    )
    return 0


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
    stream = ops.keys.outcomes
    if ops.args.from_start:
        last = "0-0"
    else:  # the current end as an id, so nothing published between two reads is missed (as with `$`)
        newest = ops.r.xrevrange(stream, count=1)
        last = newest[0][0].decode() if newest else "0-0"
    seen = 0
    try:
        while True:
            # Short blocks: redis-py's default socket timeout (5 s) would cut a longer one off.
            for _, entries in ops.r.xread({stream: last}, count=100, block=1000) or ():
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    outcome = decode_fields(fields)
                    if ops.args.json:
                        print(json.dumps({"id": last, **outcome}), flush=True)
                    else:
                        rest = " ".join(f"{k}={v}" for k, v in outcome.items() if k not in ("at", "type", "workflow"))
                        print(
                            f"{render.when(outcome.get('at'))}  {outcome.get('type', '?'):<24} "
                            f"{outcome.get('workflow', '?')}  {rest}".rstrip(),
                            flush=True,
                        )
                    seen += 1
                    if ops.args.count and seen >= ops.args.count:
                        return 0
    except KeyboardInterrupt:
        return 0


# Acting on a workflow -----------------------------------------------------------------------


def _operator(command: str) -> Callable[[Ops], int]:
    def run(ops: Ops) -> int:
        args, keys = ops.args, ops.keys
        workflow, step = args.workflow, args.step
        by = args.by or os.environ.get("USER") or os.environ.get("LOGNAME") or "operator"
        try:
            prepared = operators.prepare(ops.reader, workflow, command, step, by, args.note or "")
            sent = operators.send(ops.r, keys, prepared)
        except operators.CommandRefused as exc:
            raise CliError(str(exc)) from None
        payload, targets = prepared.payload, prepared.targets
        report: dict[str, Any] = {
            "sent": payload.TYPE,
            "workflow": workflow,
            "step": step,
            "steps": targets,
            "by": by,
            "note": payload.note,
            "id": sent.id,
        }
        if not args.json:
            print(
                f"sent {payload.TYPE} for {workflow}"
                + (f" step {step}" if step else f" ({', '.join(targets)})")
                + f" by {by} as {keys.events} entry {sent.id}"
            )
            if prepared.hint:
                print(f"note: {prepared.hint}")
        if args.wait is None:
            if args.json:
                render.emit_json(report)
            return 0

        try:
            outcome = operators.await_applied(ops.r, keys, sent, args.wait)
        except operators.CommandRefused as exc:
            raise CliError(str(exc)) from None
        report["outcome"] = outcome
        if outcome != "pending":
            state, comps = load_workflow(ops, workflow)
            report["workflowStatus"] = state.status
            report["stepStatus"] = {s: comps[s].status for s in targets if s in comps}
        if args.json:
            render.emit_json(report)
        elif outcome != "pending":
            now = ", ".join(f"step {s} is {v}" for s, v in report["stepStatus"].items())
            print(f"{outcome}: workflow {workflow} is {state.status}; {now}")
        if outcome == "applied":
            return 0
        if outcome == "pending":
            why = f"not taken within {args.wait:g}s (is a coordinator running?)"
        else:
            why = "taken, but it changed nothing: the records changed meanwhile"
        print(f"saga {command}: sent as {sent.id}, {why}", file=sys.stderr)
        return 1

    return run


# The service as a whole -----------------------------------------------------------------------


def cmd_stats(ops: Ops) -> int:
    from rq import Queue

    keys = ops.keys
    counts = ops.reader.counts()
    pipe = ops.r.pipeline(transaction=False)
    for stream in (keys.events, keys.outcomes, keys.dead_letter):
        pipe.xlen(stream)
    events, outcomes, dead = pipe.execute()
    try:
        groups = [
            {
                "name": render.text(g["name"]),
                "consumers": g["consumers"],
                "pending": g["pending"],
                "lag": g.get("lag"),
                "lastDelivered": render.text(g["last-delivered-id"]),
            }
            for g in ops.r.xinfo_groups(keys.events)
        ]
    except ResponseError:  # no stream yet: nothing was ever published
        groups = []
    queue = Queue(keys.queue, connection=ops.r)
    # Registry counts without cleanup: looking must not move jobs between registries.
    depth = {"queued": queue.count} | {
        name: getattr(queue, f"{name}_job_registry").get_job_count(cleanup=False)
        for name in ("started", "scheduled", "deferred", "failed")
    }
    stats = {
        "workflows": counts,
        "queue": {"name": keys.queue, **depth},
        "events": {"length": events, "groups": groups},
        "outcomes": outcomes,
        "deadLetters": dead,
    }
    if ops.args.json:
        render.emit_json(stats)
        return 0
    out = render.console()
    out.print(render.pairs("workflows by status", stats["workflows"].items(), skip_empty=False))
    out.print(render.pairs(f"RQ queue {keys.queue!r}", depth.items(), skip_empty=False))
    out.print(
        render.pairs(
            "streams",
            [(keys.events, events), (keys.outcomes, outcomes), (keys.dead_letter, dead)],
            skip_empty=False,
        )
    )
    if groups:
        columns = "group, consumers, pending, lag, last delivered"
        rows = [(g["name"], g["consumers"], g["pending"], g["lag"], g["lastDelivered"]) for g in groups]
        out.print(render.table(f"consumer groups on {keys.events}", columns, rows))
    else:
        out.print(f"no consumer group on {keys.events}: no coordinator has started", markup=False)
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
            f"{ops.keys.dead_letter} (newest first, at most {ops.args.limit})",
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


# Checking a server's declarations -------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from mcp_saga.runtime.recovery_wire import ToolDeclaration
    from mcp_saga.runtime.sessions import SessionError, SessionPool
    from mcp_saga.schemas.check import Problem, ToolSchemas, check_declaration
    from mcp_saga.schemas.recovery import RecoveryError, parse_recovery

    config, name = config_of(args), args.server
    server = config.servers.get(name)
    if server is None:
        known = ", ".join(config.servers) or "none: pass --config FILE or set SAGA_CONFIG"
        raise CliError(f"no server {name!r} in the config (configured: {known})")
    # The pool logs each failed connect as "reconnecting"; here the one-line error below says it all.
    sessions_log = logging.getLogger("saga.sessions")
    level = sessions_log.level
    sessions_log.setLevel(logging.ERROR)
    try:
        with SessionPool({name: server}, tools_ttl=0) as pool:
            declared: dict[str, ToolDeclaration] = pool.tools(name)
    except SessionError as exc:
        raise CliError(f"cannot list the tools of {name!r}: {exc}") from None
    finally:
        sessions_log.setLevel(level)
    schemas = {tool: ToolSchemas(d.input_schema, d.output_schema) for tool, d in declared.items()}

    def wire(recovery: Any) -> dict[str, Any] | None:
        try:
            return parse_recovery(recovery).to_wire()
        except RecoveryError:
            return None

    checked: list[dict[str, Any]] = []
    for tool, d in sorted(declared.items()):
        if d.recovery is None:
            continue
        parsed = d.parsed_recovery()
        operation = parsed.compensating_operation if parsed is not None else None
        consented = operation is not None and not config.policy.self_inverse_refusal(
            name, tool, operation.operation_id, "server"
        )
        problems = check_declaration(tool, d.recovery, schemas, self_inverse=consented)
        if d.problem and d.parsed_recovery() is not None:  # an invalid one is already an error above
            problems.append(Problem(tool, "recovery", d.problem, "warning"))
        if tool in server.recovery and server.recovery[tool].to_wire() != wire(d.recovery):
            problems.append(Problem(tool, "recovery", "the config's overlay overrides this declaration", "warning"))
        checked.append(
            {"tool": tool, "source": f"server ({d.recovery_source})", "recovery": d.recovery, "problems": problems}
        )
    for tool, recovery in sorted(server.recovery.items()):
        checked.append(
            {
                "tool": tool,
                "source": "overlay",
                "recovery": recovery.to_wire(),
                "problems": check_declaration(tool, recovery, schemas, self_inverse=True),
            }
        )
    errors = sum(p.severity == "error" for c in checked for p in c["problems"])
    warnings = sum(p.severity == "warning" for c in checked for p in c["problems"])
    summary = (
        f"{name}: {len(declared)} tools listed, {len(checked)} recovery declaration(s) checked; "
        f"{errors} error(s), {warnings} warning(s)"
    )
    if args.json:
        for c in checked:
            c["problems"] = [msgspec.to_builtins(p) for p in c["problems"]]
        render.emit_json(
            {"server": name, "tools": sorted(declared), "checked": checked, "errors": errors, "warnings": warnings}
        )
        return 1 if errors else 0

    rows = []
    for c in checked:
        op = (c["recovery"].get("compensatingOperation") or {}) if isinstance(c["recovery"], dict) else {}
        operation = op.get("operationId") if isinstance(op, dict) else None
        if not c["problems"]:
            rows.append((c["tool"], c["source"], operation, "ok", "", ""))
        rows += [(c["tool"], c["source"], operation, p.severity, p.field, p.message) for p in c["problems"]]
    out = render.console()
    out.print(render.table(f"recovery declarations of {name!r}", "tool, source, undo, severity, field, problem", rows))
    out.print(summary, markup=False)
    return 1 if errors else 0


# Wiring ------------------------------------------------------------------------------------


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 <= number <= 86_400:
        raise argparse.ArgumentTypeError(f"{value!r} must be within 0..86400 seconds")
    return number


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    def add(name: str, run: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        common(p)
        p.add_argument("--json", action="store_true", help="machine-readable JSON instead of tables")
        p.set_defaults(run=run)
        return p

    p = add("inspect", _with_redis(cmd_inspect), "a workflow's state, step stack, compensations and timeline")
    p.add_argument("workflow")
    p.add_argument("--last", type=_positive, metavar="N", help="show only the last N timeline entries")

    p = add("list", _with_redis(cmd_list), "workflows by status, newest first")
    p.add_argument("--status", choices=STATUSES)
    p.add_argument("--limit", type=_positive, default=50, metavar="N", help="at most N workflows (default 50)")

    p = add("watch", _with_redis(cmd_watch), "follow workflow and compensation outcomes (Ctrl-C to stop)")
    p.add_argument("--from-start", action="store_true", help="print the outcomes already recorded first")
    p.add_argument("--count", type=_positive, metavar="N", help="exit after N outcomes")

    actions = {
        "retry": "dispatch failed, refused or unrecoverable compensations again (all of them without --step)",
        "resolve": "record that a person undid the step by hand; unwinding continues",
        "skip": "leave the step as it is; unwinding continues",
        "approve": "allow a compensation the policy holds for approval",
    }
    for command, help in actions.items():
        p = add(command, _with_redis(_operator(command)), help)
        p.add_argument("workflow")
        p.add_argument("--step", required=command != "retry", help="the step id")
        p.add_argument("--note", required=command == "resolve", help="why; kept on the timeline")
        p.add_argument("--by", help="who is acting (default: $USER)")
        p.add_argument("--wait", type=_seconds, metavar="SECONDS", help="wait until the coordinator applied it")

    p = add("check", cmd_check, "check a configured server's recovery declarations against its live tools/list")
    p.add_argument("server", help="a server name from the config")

    add("stats", _with_redis(cmd_stats), "workflows by status, queue depth, streams and consumer lag")

    p = add("dead-letters", _with_redis(cmd_dead_letters), "recent events the coordinator could not use, and why")
    p.add_argument("--limit", type=_positive, default=20, metavar="N", help="at most N entries (default 20)")
