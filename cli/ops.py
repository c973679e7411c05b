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
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
from mcp_saga.cli import render
from mcp_saga.cli.args import CliError, config_of, redis_url
from mcp_saga.coordinator.machine import RETRYABLE, operator_refusal
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import (
    STEP_ID,
    WORKFLOW_ID,
    OperatorApprove,
    OperatorCommand,
    OperatorResolve,
    OperatorRetry,
    OperatorSkip,
    entry_fields,
)
from mcp_saga.schemas.keys import DEAD_AT, DEAD_ID, DEAD_REASON, STATUSES, Keys
from mcp_saga.schemas.records import UNWINDING, Compensation, WorkflowState, comp_decoder, state_from_hash
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

OPERATOR: dict[str, type[OperatorCommand]] = {
    "retry": OperatorRetry,
    "resolve": OperatorResolve,
    "skip": OperatorSkip,
    "approve": OperatorApprove,
}
# Keep in step with the caps of `OperatorCommand`, so an over-long value is refused here, not dead-lettered.
MAX_BY, MAX_NOTE = 200, 8192


@dataclass(frozen=True, slots=True)
class Ops:
    args: argparse.Namespace
    r: redis.Redis
    keys: Keys
    config: Config


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


def _check_workflow_id(workflow: str) -> None:
    if not re.fullmatch(WORKFLOW_ID, workflow):
        raise CliError(f"invalid workflow id {workflow[:80]!r} (must match {WORKFLOW_ID})")


def load_workflow(ops: Ops, workflow: str) -> tuple[WorkflowState, dict[str, Compensation]]:
    _check_workflow_id(workflow)
    pipe = ops.r.pipeline(transaction=False)
    pipe.hgetall(ops.keys.state(workflow))
    pipe.hgetall(ops.keys.comp(workflow))
    raw_state, raw_comps = pipe.execute()
    if not raw_state:
        raise CliError(f"no workflow {workflow!r} (never seen by a coordinator, or expired)")
    comps = {k.decode(): comp_decoder.decode(v) for k, v in raw_comps.items()}
    return state_from_hash(raw_state), dict(sorted(comps.items(), key=lambda kv: kv[1].seq))


def state_dict(state: WorkflowState) -> dict[str, Any]:
    """Every field under its hash name; `to_builtins` would drop defaults such as status `running`."""
    return {f.encode_name: getattr(state, f.name) for f in msgspec.structs.fields(state)}


def _decode(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _result_summary(result: Any) -> str:
    """The part of a CallToolResult a person looks for: its structured body, else its text."""
    if not isinstance(result, dict):
        return render.text(result, 60)
    body = result.get("structuredContent")
    if body is None:
        blocks = result.get("content") if isinstance(result.get("content"), list) else []
        body = " ".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict) and b.get("type") == "text")
    return ("error: " if result.get("isError") else "") + render.text(body, 60)


def cmd_inspect(ops: Ops) -> int:
    workflow = ops.args.workflow
    state, comps = load_workflow(ops, workflow)
    pipe = ops.r.pipeline(transaction=False)
    pipe.ttl(ops.keys.state(workflow))
    pipe.lrange(ops.keys.steps(workflow), 0, -1)
    if ops.args.last:
        pipe.xrevrange(ops.keys.log(workflow), count=ops.args.last)
    else:
        pipe.xrange(ops.keys.log(workflow))
    ttl, raw_steps, raw_log = pipe.execute()
    steps = [_json_or_text(s) for s in raw_steps]
    log = [{"id": i.decode(), **_decode(f)} for i, f in raw_log]
    if ops.args.last:
        log.reverse()
    if ops.args.json:
        render.emit_json(
            {
                "workflow": workflow,
                "state": state_dict(state),
                "expiresIn": ttl if ttl >= 0 else None,
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
                ("expires in", f"{ttl / 3600:.1f} h" if ttl >= 0 else ""),
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
    statuses = [ops.args.status] if ops.args.status else list(STATUSES)
    pipe = ops.r.pipeline(transaction=False)
    for status in statuses:
        pipe.zrevrange(ops.keys.index(status), 0, limit - 1, withscores=True)
    newest = sorted(((score, wf.decode()) for page in pipe.execute() for wf, score in page), reverse=True)
    names = list(dict.fromkeys(wf for _, wf in newest))[:limit]
    for workflow in names:
        pipe.hgetall(ops.keys.state(workflow))
    rows = []
    for workflow, raw in zip(names, pipe.execute(), strict=True):
        if not raw:  # expired; the coordinator's sweep drops it from the index later
            continue
        state = state_from_hash(raw)
        rows.append(
            {
                "workflow": workflow,
                "status": state.status,
                "steps": state.steps,
                "updatedAt": state.updated_at,
                "attention": state.attention,
            }
        )
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
                    outcome = _decode(fields)
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
        note = args.note or ""
        if len(by) > MAX_BY or not by.strip():
            raise CliError(f"--by must be 1 to {MAX_BY} characters")
        if len(note) > MAX_NOTE:
            raise CliError(f"--note is {len(note)} characters; at most {MAX_NOTE}")
        if step is not None and not re.fullmatch(STEP_ID, step):
            raise CliError(f"invalid step id {step[:80]!r} (must match {STEP_ID})")
        state, comps = load_workflow(ops, workflow)
        if state.status not in UNWINDING:
            raise CliError(
                f"workflow {workflow!r} is {state.status}; operator commands apply only once it has failed "
                f"({', '.join(sorted(UNWINDING))})"
            )
        if step is not None:
            if step not in comps:
                known = ", ".join(comps) or "none recorded"
                raise CliError(f"workflow {workflow!r} has no step {step!r} (steps: {known})")
            if (why := operator_refusal(command, comps[step])) is not None:
                raise CliError(why)
            targets = [step]
        else:  # only retry may omit --step: it then retries every retryable step
            targets = [s for s, c in comps.items() if operator_refusal(command, c) is None]
            if not targets:
                raise CliError(
                    f"nothing to retry in {workflow!r}: no step is {', '.join(RETRYABLE)} with a usable compensation"
                )

        marks = (_last_id(ops.r, keys.log(workflow)), _last_id(ops.r, keys.dead_letter))
        payload = OPERATOR[command](step=step, by=by, note=note)
        sent = ops.r.xadd(keys.events, entry_fields(workflow, payload)).decode()
        report: dict[str, Any] = {
            "sent": payload.TYPE,
            "workflow": workflow,
            "step": step,
            "steps": targets,
            "by": by,
            "note": note,
            "id": sent,
        }
        hint = None
        if command == "approve" and comps[targets[0]].status in ("failed", "unrecoverable"):
            hint = f"the approval applies to its next dispatch: `saga retry {workflow} --step {step}`"
        elif command == "retry" and (
            held := [s for s in targets if comps[s].status == "awaiting-approval" and not comps[s].approved]
        ):
            hint = f"the policy held {', '.join(held)} for approval; unless it changed, `saga approve` instead"
        if not args.json:
            print(
                f"sent {payload.TYPE} for {workflow}"
                + (f" step {step}" if step else f" ({', '.join(targets)})")
                + f" by {by} as {keys.events} entry {sent}"
            )
            if hint:
                print(f"note: {hint}")
        if args.wait is None:
            if args.json:
                render.emit_json(report)
            return 0

        outcome = _await_applied(ops, workflow, payload, sent, marks, args.wait)
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
        print(f"saga {command}: sent as {sent}, {why}", file=sys.stderr)
        return 1

    return run


def _last_id(r: redis.Redis, stream: str) -> str | None:
    newest = r.xrevrange(stream, count=1)
    return newest[0][0].decode() if newest else None


def _id(entry_id: str | bytes) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def _taken(ops: Ops, sent: str) -> bool:
    """Whether the coordinators' group has read and acknowledged the entry (so its effects are written)."""
    try:
        groups = ops.r.xinfo_groups(ops.keys.events)
    except ResponseError:
        return False
    group = next((g for g in groups if render.text(g["name"]) == ops.keys.group), None)
    if group is None or _id(group["last-delivered-id"]) < _id(sent):
        return False
    return not ops.r.xpending_range(ops.keys.events, ops.keys.group, min=sent, max=sent, count=1)


def _await_applied(
    ops: Ops, workflow: str, payload: OperatorCommand, sent: str, marks: tuple[str | None, str | None], timeout: float
) -> str:
    """Follow one command until the coordinator took it: "applied", "unchanged", or "pending" at the deadline.

    The coordinator commits a command's timeline entry (or its dead letter) before it acknowledges
    the event, so once the entry is acknowledged, finding neither means the command was a no-op
    (another command or a worker's report got there first). Polling, not XREAD BLOCK, because the
    answer may be in either of two streams or in the consumer group.
    """
    log_mark, dead_mark = marks
    want = {b"type": payload.TYPE.encode(), b"by": payload.by.encode()}
    if payload.step is not None:
        want[b"step"] = payload.step.encode()
    deadline = time.monotonic() + timeout
    while True:
        taken = _taken(ops, sent)
        for entry_id, fields in ops.r.xrange(ops.keys.log(workflow), min=f"({log_mark}" if log_mark else "-"):
            log_mark = entry_id.decode()
            if all(fields.get(k) == v for k, v in want.items()):
                return "applied"
        for entry_id, fields in ops.r.xrange(ops.keys.dead_letter, min=f"({dead_mark}" if dead_mark else "-"):
            dead_mark = entry_id.decode()
            if fields.get(DEAD_ID.encode(), b"").decode() == sent:
                reason = fields.get(DEAD_REASON.encode(), b"").decode(errors="replace")
                raise CliError(f"sent as {sent}, but the coordinator rejected it: {reason}")
        if taken:
            return "unchanged"
        if time.monotonic() >= deadline:
            return "pending"
        time.sleep(0.1)


# The service as a whole -----------------------------------------------------------------------


def cmd_stats(ops: Ops) -> int:
    from rq import Queue

    keys = ops.keys
    pipe = ops.r.pipeline(transaction=False)
    for status in STATUSES:
        pipe.zcard(keys.index(status))
    for stream in (keys.events, keys.outcomes, keys.dead_letter):
        pipe.xlen(stream)
    *counts, events, outcomes, dead = pipe.execute()
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
        "workflows": dict(zip(STATUSES, counts, strict=True)),
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
    entries = []
    for entry_id, fields in ops.r.xrevrange(ops.keys.dead_letter, count=ops.args.limit):
        data = _decode(fields)
        entries.append(
            {
                "id": entry_id.decode(),
                "at": data.pop(DEAD_AT, None),
                "reason": data.pop(DEAD_REASON, ""),
                "originalId": data.pop(DEAD_ID, None),
                "fields": data,
            }
        )
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
        problems = check_declaration(tool, d.recovery, schemas)
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
                "problems": check_declaration(tool, recovery, schemas),
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
