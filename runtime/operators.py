"""Sending an operator command: checked against the current records first, then one event on `saga:events`.

The `saga` command and the web console both act through here, so they refuse the same pointless
commands with the same reasons, and send the same events: the coordinator stays the only writer and
the timeline records who did what.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from mcp_saga.runtime.reader import Reader, text_of
from mcp_saga.schemas.events import (
    BY_MAX,
    TEXT_MAX,
    OperatorCommand,
    check_step_id,
    check_workflow_id,
    entry_fields,
    stream_id,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.operators import COMMANDS, RETRYABLE, operator_refusal
from mcp_saga.schemas.records import UNWINDING
from mcp_saga.schemas.timeline import DeadLetter, TimelineEntry
from redis import Redis
from redis.exceptions import ResponseError

Outcome = Literal["applied", "unchanged", "pending"]


class CommandRefused(ValueError):
    """The command would change nothing (or names nothing); the message says why, for a person."""


@dataclass(frozen=True)
class Prepared:
    workflow: str
    command: str
    payload: OperatorCommand
    # The steps the command acts on (retry without a step: every retryable one).
    targets: list[str]
    # Something the operator should know, such as "approve instead".
    hint: str | None


@dataclass(frozen=True)
class Sent:
    prepared: Prepared
    id: str
    # The newest timeline and dead-letter ids before sending, to find what the command caused.
    log_mark: str | None
    dead_mark: str | None


def check_ids(workflow: str, step: str | None = None) -> None:
    try:
        check_workflow_id(workflow)
        if step is not None:
            check_step_id(step)
    except ValueError as exc:
        raise CommandRefused(str(exc)) from None


def prepare(reader: Reader, workflow: str, command: str, step: str | None, by: str, note: str = "") -> Prepared:
    """Build the command's event, or refuse it with the reason."""
    if command not in COMMANDS:
        raise CommandRefused(f"unknown command {command!r} (one of {', '.join(COMMANDS)})")
    if len(by) > BY_MAX or not by.strip():
        raise CommandRefused(f"the operator's name must be 1 to {BY_MAX} characters")
    if len(note) > TEXT_MAX:
        raise CommandRefused(f"the note is {len(note)} characters; at most {TEXT_MAX}")
    check_ids(workflow, step)
    if step is None and command != "retry":
        raise CommandRefused(f"{command} needs a step")
    if command == "resolve" and not note.strip():
        raise CommandRefused("resolve needs a note: what was done by hand, for the timeline")
    loaded = reader.records(workflow)
    if loaded is None:
        raise CommandRefused(f"no workflow {workflow!r} (never seen by a coordinator, or expired)")
    state, comps = loaded
    if state.status not in UNWINDING:
        raise CommandRefused(
            f"workflow {workflow!r} is {state.status}; operator commands apply only once it has failed "
            f"({', '.join(sorted(UNWINDING))})"
        )
    if step is not None:
        if step not in comps:
            known = ", ".join(comps) or "none recorded"
            raise CommandRefused(f"workflow {workflow!r} has no step {step!r} (steps: {known})")
        if (why := operator_refusal(command, comps[step])) is not None:
            raise CommandRefused(why)
        targets = [step]
    else:
        targets = [s for s, c in comps.items() if operator_refusal(command, c) is None]
        if not targets:
            raise CommandRefused(
                f"nothing to retry in {workflow!r}: no step is {', '.join(RETRYABLE)} with a usable compensation"
            )
    hint = None
    if command == "approve" and comps[targets[0]].status in ("failed", "unrecoverable"):
        hint = f"the approval applies to its next dispatch: `saga retry {workflow} --step {step}`"
    elif command == "retry" and (
        held := [s for s in targets if comps[s].status == "awaiting-approval" and not comps[s].approved]
    ):
        hint = f"the policy held {', '.join(held)} for approval; unless it changed, `saga approve` instead"
    payload = COMMANDS[command](step=step, by=by, note=note)
    return Prepared(workflow, command, payload, targets, hint)


def send(redis: Redis, keys: Keys, prepared: Prepared) -> Sent:
    keys = keys.route(prepared.workflow)  # the command joins its workflow's partition
    log_mark = _last_id(redis, keys.log(prepared.workflow))
    dead_mark = _last_id(redis, keys.dead_letter)
    entry_id = redis.xadd(keys.events, entry_fields(prepared.workflow, prepared.payload)).decode()
    return Sent(prepared, entry_id, log_mark, dead_mark)


def await_applied(redis: Redis, keys: Keys, sent: Sent, timeout: float) -> Outcome:
    """Follow one command until the coordinator took it: "applied", "unchanged", or "pending" at the deadline.

    The coordinator commits a command's timeline entry (or its dead letter) before it acknowledges
    the event, so once the entry is acknowledged, finding neither means the command was a no-op
    (another command or a worker's report got there first). Polling, not XREAD BLOCK, because the
    answer may be in either of two streams or in the consumer group. A dead letter raises
    `CommandRefused` with the coordinator's reason.
    """
    payload, workflow = sent.prepared.payload, sent.prepared.workflow
    keys = keys.route(workflow)
    log_mark, dead_mark = sent.log_mark, sent.dead_mark
    deadline = time.monotonic() + timeout
    while True:
        taken = _taken(redis, keys, sent.id)
        for entry_id, fields in redis.xrange(keys.log(workflow), min=f"({log_mark}" if log_mark else "-"):
            log_mark = entry_id.decode()
            entry = TimelineEntry.from_fields(fields)
            if entry.type == payload.TYPE and entry.by == payload.by and payload.step in (None, entry.step):
                return "applied"
        for entry_id, fields in redis.xrange(keys.dead_letter, min=f"({dead_mark}" if dead_mark else "-"):
            dead_mark = entry_id.decode()
            letter = DeadLetter.from_fields(entry_id, fields)
            if letter.original_id == sent.id:
                raise CommandRefused(f"sent as {sent.id}, but the coordinator rejected it: {letter.reason}")
        if taken:
            return "unchanged"
        if time.monotonic() >= deadline:
            return "pending"
        time.sleep(0.1)


def _last_id(redis: Redis, stream: str) -> str | None:
    newest = redis.xrevrange(stream, count=1)
    return newest[0][0].decode() if newest else None


def _taken(redis: Redis, keys: Keys, sent: str) -> bool:
    """Whether the coordinators' group has read and acknowledged the entry (so its effects are written)."""
    try:
        groups = redis.xinfo_groups(keys.events)
    except ResponseError:
        return False
    group = next((g for g in groups if text_of(g["name"]) == keys.group), None)
    if group is None or stream_id(group["last-delivered-id"]) < stream_id(sent):
        return False
    return not redis.xpending_range(keys.events, keys.group, min=sent, max=sent, count=1)
