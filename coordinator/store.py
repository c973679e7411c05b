"""Reading workflow views from Redis and committing transitions: the coordinator's only I/O on state.

Reads and writes are pipelined per batch of events: one round trip loads every workflow the batch
touches, one commits every transition (a compare-and-set Lua script per workflow), one performs
the follow-ups that live outside the workflow's slot (indexes, outcomes, watchdog deadlines).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

from mcp_saga.coordinator.machine import WorkflowView
from mcp_saga.runtime.reader import decode_records
from mcp_saga.schemas.config import CoordinatorSettings
from mcp_saga.schemas.keys import STATUSES, Keys
from mcp_saga.schemas.records import Compensation, comp_decoder, comp_encoder, state_from_hash
from redis import Redis

LOG_MAXLEN = 10_000


def load_script(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text()


class Store:
    def __init__(self, redis: Redis, keys: Keys, settings: CoordinatorSettings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._apply = redis.register_script(load_script("apply.lua"))
        self._record_steps = redis.register_script(load_script("record_steps.lua"))
        self._gc_cursor: dict[str, int] = {}

    def load(self, wanted: dict[str, tuple[bool, Iterable[str]]]) -> dict[str, WorkflowView]:
        """Load views: workflow -> (needs every record?, step ids the batch names)."""
        pipe = self.redis.pipeline(transaction=False)
        for workflow, (full, steps) in wanted.items():
            pipe.hgetall(self.keys.state(workflow))
            if full:
                pipe.hgetall(self.keys.comp(workflow))
            else:
                pipe.hmget(self.keys.comp(workflow), list(steps) or ["-"])
        replies = iter(pipe.execute())
        views = {}
        for workflow, (full, steps) in wanted.items():
            state = state_from_hash(next(replies))
            records = next(replies)
            if full:
                comps = decode_records(records)
            else:
                comps = {s: comp_decoder.decode(v) for s, v in zip(steps, records, strict=False) if v is not None}
            views[workflow] = WorkflowView(workflow, state, comps, full)
        return views

    def ttl_for(self, status: str) -> int:
        s = self.settings
        return {
            "completed": s.retention_completed,
            "compensated": s.retention_compensated,
            "needs-attention": s.retention_attention,
        }.get(status, s.idle_ttl)

    def commit(self, views: list[WorkflowView]) -> list[bool]:
        """Apply each dirty view atomically; False where another coordinator changed it meanwhile."""
        pipe = self.redis.pipeline(transaction=False)
        for view in views:
            state = view.state
            args: list[str | bytes | int] = [
                view.loaded_version,
                self.ttl_for(state.status),
                LOG_MAXLEN,
                len(state_pairs := state.to_hash()),
                len(view.changed),
                len(view.new_steps),
                len(view.log),
            ]
            for k, v in state_pairs.items():
                args += (k, v)
            for step, comp in view.changed.items():
                args += (step, comp_encoder.encode(comp))
            args += view.new_steps
            for entry in view.log:
                args.append(len(entry))
                for k, v in entry.items():
                    args += (k, v)
            self._apply(keys=self.keys.workflow_keys(view.workflow), args=args, client=pipe)
        return [bool(ok) for ok in pipe.execute()]

    def record_steps(
        self, batches: dict[str, list[tuple[Compensation, bytes, list[dict[str, str]]]]], now: float
    ) -> dict[str, tuple[bool, int] | None]:
        """Record new steps of workflows believed running, without loading them first.

        workflow -> (created?, steps recorded), or None where the workflow is not running after all
        (the caller then folds those events through the compare-and-set path).
        """
        pipe = self.redis.pipeline(transaction=False)
        ttl = self.settings.idle_ttl
        for workflow, steps in batches.items():
            args: list[str | bytes | int] = [f"{now:.6f}", ttl, LOG_MAXLEN, len(steps)]
            for comp, raw, entries in steps:
                record = comp_encoder.encode(comp)
                assert record.startswith(b'{"step":"%s","seq":0,' % comp.step.encode())  # what the script patches
                args += (comp.step, record, raw, len(entries))
                for entry in entries:
                    args.append(len(entry))
                    for k, v in entry.items():
                        args += (k, v)
            self._record_steps(keys=self.keys.workflow_keys(workflow), args=args, client=pipe)
        replies = pipe.execute()
        return {
            workflow: None if reply == -1 else (bool(reply[0]), int(reply[1]))
            for workflow, reply in zip(batches, replies, strict=True)
        }

    def follow_up(self, views: list[WorkflowView], deadlines: dict[str, float | None], extra: list) -> None:
        """Index, outcomes and watchdog deadlines for committed views, plus the caller's acks.

        `deadlines` names only the workflows whose watchdog deadline is known (full views):
        None removes it, a time sets it, absent leaves it alone.
        """
        pipe = self.redis.pipeline(transaction=False)
        now = max((v.state.updated_at for v in views), default=0.0)
        for view in views:
            status = view.state.status
            if status != view.loaded_status:
                if view.loaded_status:
                    pipe.zrem(self.keys.index(view.loaded_status), view.workflow)
                pipe.zadd(self.keys.index(status), {view.workflow: view.state.updated_at or now})
            for outcome in view.outcomes:
                pipe.xadd(self.keys.outcomes, outcome, maxlen=self.settings.outcomes_maxlen, approximate=True)
            if view.workflow not in deadlines:  # a running workflow's partial view: nothing to watch
                continue
            deadline = deadlines[view.workflow]
            if deadline is None:
                pipe.zrem(self.keys.deadlines, view.workflow)
            else:
                pipe.zadd(self.keys.deadlines, {view.workflow: deadline})
        for command in extra:
            command(pipe)
        pipe.execute()

    def due(self, now: float, limit: int = 100) -> list[str]:
        return [w.decode() for w in self.redis.zrangebyscore(self.keys.deadlines, "-inf", now, start=0, num=limit)]

    def collect_garbage(self, count: int = 500) -> int:
        """Drop index and deadline entries whose workflow expired (its keys are gone).

        Walks each sorted set with ZSCAN a slice at a time, so one sweep costs little however
        many workflows exist, and successive sweeps cover them all.
        """
        removed = 0
        for key in [self.keys.index(s) for s in STATUSES] + [self.keys.deadlines]:
            cursor, members = self.redis.zscan(key, self._gc_cursor.get(key, 0), count=count)
            self._gc_cursor[key] = cursor
            names = [m.decode() for m, _ in members]
            if not names:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for workflow in names:
                pipe.exists(self.keys.state(workflow))
            gone = [w for w, alive in zip(names, pipe.execute(), strict=True) if not alive]
            if gone:
                removed += self.redis.zrem(key, *gone)
        return removed
