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
from mcp_saga.schemas.events import stream_id
from mcp_saga.schemas.keys import STATUSES, Keys, key_slot
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


class Partition(msgspec.Struct, frozen=True):
    """One partition of the events: where its keys live and who reads it."""

    partition: int
    stream: str
    slot: int
    length: int
    # None when no coordinator ever created the group on this partition's stream.
    lag: int | None
    pending: int
    # The coordinators reading this partition (the group's consumers), pending entries each.
    coordinators: list[Consumer]


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
    # Per partition (one entry with a single partition): stream, slot, and who reads it.
    partitions: list[Partition] = msgspec.field(default_factory=list)


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
    """Reads one workflow's keys where they live, and gathers the partitioned ones across partitions.

    `queue` is the RQ queue's Redis when it is not `redis` (`[redis] queue_url`, always with a cluster).
    """

    def __init__(self, redis: Redis, keys: Keys, queue: Redis | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue if queue is not None else redis

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
        """Workflows per status, from the status indexes of every partition."""
        pipe = self.redis.pipeline(transaction=False)
        for keys in self.keys.every():
            for status in STATUSES:
                pipe.zcard(keys.index(status))
        found = pipe.execute()
        return {s: sum(found[n :: len(STATUSES)]) for n, s in enumerate(STATUSES)}

    def recent(self, status: str | None = None, limit: int = 50, offset: int = 0) -> list[tuple[str, WorkflowState]]:
        """The newest workflows (in one status, or any), newest first, from `offset`; expired ones are left out.

        Across statuses each index is read up to `offset + limit`, so a deep page costs its depth.
        """
        statuses = [status] if status else list(STATUSES)
        pipe = self.redis.pipeline(transaction=False)
        for keys in self.keys.every():
            for s in statuses:
                pipe.zrevrange(keys.index(s), 0, offset + limit - 1, withscores=True)
        newest = sorted(((score, wf.decode()) for page in pipe.execute() for wf, score in page), reverse=True)
        return self._states(list(dict.fromkeys(wf for _, wf in newest))[offset : offset + limit])

    def search(self, prefix: str, limit: int = 50) -> list[tuple[str, WorkflowState]]:
        """Workflows whose id starts with `prefix`, by ZSCAN over the status indexes (no KEYS, no full read)."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        found: dict[str, None] = {}
        for key in (keys.index(status) for keys in self.keys.every() for status in STATUSES):
            for member, _ in self.redis.zscan_iter(key, match=pattern, count=500):
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

        queue = Queue(self.keys.queue, connection=self.queue)
        return {"queued": queue.count} | {
            name: getattr(queue, f"{name}_job_registry").get_job_count(cleanup=False) for name in QUEUE_REGISTRIES
        }

    def fleet(self) -> Fleet:
        from rq import Queue, Worker

        keys = self.keys
        pipe = self.redis.pipeline(transaction=False)
        for part in keys.every():
            for stream in (part.events, part.outcomes, part.dead_letter):
                pipe.xlen(stream)
        lengths = pipe.execute()
        parts = self.partitions(lengths[0::3])
        workers = [
            RqWorker(
                name=w.name,
                state=str(w.get_state()),
                current_job=w.get_current_job_id(),
                last_heartbeat=w.last_heartbeat.timestamp() if w.last_heartbeat else None,
                successful=w.successful_job_count,
                failed=w.failed_job_count,
            )
            for w in Worker.all(queue=Queue(keys.queue, connection=self.queue))
        ]
        consumers: dict[str, Consumer] = {}
        for part in parts:  # a coordinator reading several partitions: one row, its pending entries summed
            for c in part.coordinators:
                seen = consumers.get(c.name)
                consumers[c.name] = (
                    c if seen is None else Consumer(c.name, seen.pending + c.pending, min(seen.idle_ms, c.idle_ms))
                )
        groups = [g for g in self.groups() if text_of(g["name"]) == keys.group]
        lags = [p.lag for p in parts]
        return Fleet(
            events=sum(lengths[0::3]),
            outcomes=sum(lengths[1::3]),
            dead_letters=sum(lengths[2::3]),
            lag=None if not groups or None in lags else sum(lag or 0 for lag in lags),
            pending=sum(p.pending for p in parts),
            last_delivered=max((text_of(g["last-delivered-id"]) for g in groups), key=stream_id, default=None),
            coordinators=list(consumers.values()),
            workers=workers,
            queue=self.queue_depth(),
            partitions=parts,
        )

    def partitions(self, lengths: list[int] | None = None) -> list[Partition]:
        """Each partition's stream, its slot, its length and the coordinators reading it."""
        parts = []
        groups = self.groups()
        for part in self.keys.every():
            group = next((g for g in groups if g["partition"] == part.part and text_of(g["name"]) == part.group), None)
            consumers = []
            if group is not None:
                consumers = [
                    Consumer(text_of(c["name"]), c["pending"], c["idle"])
                    for c in self.redis.xinfo_consumers(part.events, part.group)
                ]
            parts.append(
                Partition(
                    partition=part.part or 0,
                    stream=part.events,
                    slot=key_slot(part.events),
                    length=lengths[part.part or 0] if lengths is not None else self.redis.xlen(part.events),
                    lag=group.get("lag") if group else None,
                    pending=group["pending"] if group else 0,
                    coordinators=consumers,
                )
            )
        return parts

    def groups(self) -> list[dict[str, Any]]:
        """`XINFO GROUPS` of every partition's events stream, each group with its `partition` and `stream`
        added ([] before anything was published); `lag` is None on Redis < 7."""
        found = []
        for part in self.keys.every():
            try:
                groups = self.redis.xinfo_groups(part.events)
            except ResponseError:
                continue
            found += [{**g, "partition": part.part or 0, "stream": part.events} for g in groups]
        return found

    def dead_letters(self, limit: int = 50) -> list[DeadLetter]:
        """Newest first, across partitions."""
        letters = [
            DeadLetter.from_fields(i, f)
            for part in self.keys.every()
            for i, f in self.redis.xrevrange(part.dead_letter, count=limit)
        ]
        return sorted(letters, key=lambda d: stream_id(d.id), reverse=True)[:limit]


def text_of(value: str | bytes) -> str:
    """A name redis-py returns as bytes or str (depending on the reply), as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
