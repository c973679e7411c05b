"""The one reader of a workflow's keys, for everything that looks without writing.

The coordinator's store, the `saga` command, the web console, the chaos run and the tests all read
`saga:{wf}:state`, `:comp`, `:steps` and `:log` through here, so what a record or a timeline entry
looks like on the way out of Redis is decided once.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import Compensation, WorkflowState, comp_decoder, state_from_hash
from mcp_saga.schemas.timeline import DeadLetter, TimelineEntry
from redis import Redis
from redis.exceptions import ResponseError

# RQ's job registries besides the queue itself, as `saga stats` and the metrics name them.
QUEUE_REGISTRIES = ("started", "scheduled", "deferred", "failed")


class WorkflowSnapshot(msgspec.Struct, frozen=True):
    """Everything Redis holds about one workflow, decoded."""

    workflow: str
    state: WorkflowState
    # step id -> record, in unwinding order's reverse (completion order, by `seq`).
    compensations: dict[str, Compensation]
    # The step stack as recorded (each the step-completed data); text where an entry is not JSON.
    steps: list[Any]
    # Timeline entries, oldest first, each with its stream `id`.
    timeline: list[TimelineEntry]
    # Seconds until the keys expire; None when they do not.
    expires_in: int | None


class Consumer(msgspec.Struct, frozen=True):
    """A coordinator, as its consumer group sees it."""

    name: str
    pending: int
    idle_ms: int


class RqWorker(msgspec.Struct, frozen=True):
    name: str
    state: str
    current_job: str | None
    last_heartbeat: float | None
    successful: int
    failed: int


class Fleet(msgspec.Struct, frozen=True):
    """The service as a whole: who consumes events, who performs compensations, what is waiting."""

    events: int
    outcomes: int
    dead_letters: int
    # None when no coordinator ever created the group.
    lag: int | None
    pending: int
    last_delivered: str | None
    coordinators: list[Consumer]
    workers: list[RqWorker]
    # queued, started, scheduled, deferred, failed
    queue: dict[str, int]


def decode_records(raw: dict[bytes, bytes]) -> dict[str, Compensation]:
    """The `:comp` hash, in completion order."""
    comps = {k.decode(): comp_decoder.decode(v) for k, v in raw.items()}
    return dict(sorted(comps.items(), key=lambda kv: kv[1].seq))


def state_fields(state: WorkflowState) -> dict[str, Any]:
    """Every field under its hash name; `to_builtins` would drop defaults such as status `running`."""
    return {f.encode_name: getattr(state, f.name) for f in msgspec.structs.fields(state)}


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class Reader:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    def records(self, workflow: str) -> tuple[WorkflowState, dict[str, Compensation]] | None:
        """State and compensation records; None when the workflow is unknown or expired."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.state(workflow))
        pipe.hgetall(self.keys.comp(workflow))
        raw_state, raw_comps = pipe.execute()
        if not raw_state:
            return None
        return state_from_hash(raw_state), decode_records(raw_comps)

    def snapshot(self, workflow: str, *, last: int | None = None) -> WorkflowSnapshot | None:
        """The whole workflow; `last` keeps only the newest N timeline entries."""
        keys = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(keys.state(workflow))
        pipe.hgetall(keys.comp(workflow))
        pipe.ttl(keys.state(workflow))
        pipe.lrange(keys.steps(workflow), 0, -1)
        if last:
            pipe.xrevrange(keys.log(workflow), count=last)
        else:
            pipe.xrange(keys.log(workflow))
        raw_state, raw_comps, ttl, raw_steps, raw_log = pipe.execute()
        if not raw_state:
            return None
        timeline = [TimelineEntry.from_fields(f, i) for i, f in raw_log]
        if last:
            timeline.reverse()
        return WorkflowSnapshot(
            workflow=workflow,
            state=state_from_hash(raw_state),
            compensations=decode_records(raw_comps),
            steps=[_json_or_text(s) for s in raw_steps],
            timeline=timeline,
            expires_in=ttl if ttl >= 0 else None,
        )

    def timeline_after(self, workflow: str, after: str | None) -> list[TimelineEntry]:
        """Timeline entries newer than stream id `after` (all when None): what a live view polls."""
        entries = self.redis.xrange(self.keys.log(workflow), min=f"({after}" if after else "-")
        return [TimelineEntry.from_fields(f, i) for i, f in entries]

    def counts(self) -> dict[str, int]:
        """Workflows per status, from the status indexes."""
        pipe = self.redis.pipeline(transaction=False)
        for status in STATUSES:
            pipe.zcard(self.keys.index(status))
        return dict(zip(STATUSES, pipe.execute(), strict=True))

    def recent(self, status: str | None = None, limit: int = 50, offset: int = 0) -> list[tuple[str, WorkflowState]]:
        """The newest workflows (in one status, or any), newest first, from `offset`; expired ones are left out.

        Across statuses each index is read up to `offset + limit`, so a deep page costs its depth.
        """
        statuses = [status] if status else list(STATUSES)
        pipe = self.redis.pipeline(transaction=False)
        for s in statuses:
            pipe.zrevrange(self.keys.index(s), 0, offset + limit - 1, withscores=True)
        newest = sorted(((score, wf.decode()) for page in pipe.execute() for wf, score in page), reverse=True)
        return self._states(list(dict.fromkeys(wf for _, wf in newest))[offset : offset + limit])

    def search(self, prefix: str, limit: int = 50) -> list[tuple[str, WorkflowState]]:
        """Workflows whose id starts with `prefix`, by ZSCAN over the status indexes (no KEYS, no full read)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        found: dict[str, None] = {}
        for status in STATUSES:
            for member, _ in self.redis.zscan_iter(self.keys.index(status), match=pattern, count=500):
                found[member.decode()] = None
                if len(found) >= limit:
                    break
            if len(found) >= limit:
                break
        return sorted(self._states(list(found)), key=lambda ws: ws[1].updated_at, reverse=True)

    def _states(self, names: list[str]) -> list[tuple[str, WorkflowState]]:
        pipe = self.redis.pipeline(transaction=False)
        for workflow in names:
            pipe.hgetall(self.keys.state(workflow))
        return [(wf, state_from_hash(raw)) for wf, raw in zip(names, pipe.execute(), strict=True) if raw]

    def mark(self, workflow: str) -> str:
        """A cheap token that changes whenever the workflow does (state version and newest timeline id).

        What a live view polls before it reads the whole workflow again.
        """
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.state(workflow), "version")
        pipe.xrevrange(self.keys.log(workflow), count=1)
        version, newest = pipe.execute()
        return f"{(version or b'-').decode()}.{newest[0][0].decode() if newest else '-'}"

    def queue_depth(self) -> dict[str, int]:
        """Jobs of the RQ queue by state; counted without RQ's cleanup, so looking moves no job."""
        from rq import Queue

        queue = Queue(self.keys.queue, connection=self.redis)
        return {"queued": queue.count} | {
            name: getattr(queue, f"{name}_job_registry").get_job_count(cleanup=False) for name in QUEUE_REGISTRIES
        }

    def fleet(self) -> Fleet:
        from rq import Queue, Worker

        keys = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for stream in (keys.events, keys.outcomes, keys.dead_letter):
            pipe.xlen(stream)
        events, outcomes, dead = pipe.execute()
        group = next((g for g in self.groups() if text_of(g["name"]) == keys.group), None)
        consumers = []
        if group is not None:
            consumers = [
                Consumer(text_of(c["name"]), c["pending"], c["idle"])
                for c in self.redis.xinfo_consumers(keys.events, keys.group)
            ]
        workers = [
            RqWorker(
                name=w.name,
                state=str(w.get_state()),
                current_job=w.get_current_job_id(),
                last_heartbeat=w.last_heartbeat.timestamp() if w.last_heartbeat else None,
                successful=w.successful_job_count,
                failed=w.failed_job_count,
            )
            for w in Worker.all(queue=Queue(keys.queue, connection=self.redis))
        ]
        return Fleet(
            events=events,
            outcomes=outcomes,
            dead_letters=dead,
            lag=group.get("lag") if group else None,
            pending=group["pending"] if group else 0,
            last_delivered=text_of(group["last-delivered-id"]) if group else None,
            coordinators=consumers,
            workers=workers,
            queue=self.queue_depth(),
        )

    def groups(self) -> list[dict[str, Any]]:
        """`XINFO GROUPS` of the events stream ([] before anything was published); `lag` is None on Redis < 7."""
        try:
            return self.redis.xinfo_groups(self.keys.events)
        except ResponseError:
            return []

    def dead_letters(self, limit: int = 50) -> list[DeadLetter]:
        """Newest first."""
        return [DeadLetter.from_fields(i, f) for i, f in self.redis.xrevrange(self.keys.dead_letter, count=limit)]


def text_of(value: str | bytes) -> str:
    """A name redis-py returns as bytes or str (depending on the reply), as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
