"""Acting on a stuck workflow: `saga retry|resolve|skip|approve`.

Each command is checked against the current records, so a pointless one is refused with the reason
up front, then sent as an operator event on `saga:events` (`mcp_saga.runtime.operators`, shared with
the web console): the coordinator stays the only writer and the timeline records who did what.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from mcp_saga.cli import render
from mcp_saga.cli.args import CliError, Ops, add_command, seconds, with_redis
from mcp_saga.cli.look import load_workflow
from mcp_saga.runtime import operators


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
                + f" by {by} as {keys.route(workflow).events} entry {sent.id}"
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


ACTIONS = {
    "retry": "dispatch failed, refused or unrecoverable compensations again, recall in-doubt steps (all: no --step)",
    "resolve": "record that a person undid the step by hand; unwinding continues",
    "skip": "leave the step as it is; unwinding continues",
    "approve": "allow a compensation the policy holds for approval",
}


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    for command, help in ACTIONS.items():
        p = add_command(sub, common, command, with_redis(_operator(command)), help)
        p.add_argument("workflow")
        p.add_argument("--step", required=command != "retry", help="the step id")
        p.add_argument("--note", required=command == "resolve", help="why; kept on the timeline")
        p.add_argument("--by", help="who is acting (default: $USER)")
        p.add_argument("--wait", type=seconds, metavar="SECONDS", help="wait until the coordinator applied it")
