"""Watching Redis while the run goes, and checking every guarantee against the servers' ledgers afterwards."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from mcp_saga.examples.ledger import TRANSIENT_PREFIX
from mcp_saga.schemas.events import stream_id
from mcp_saga.schemas.keys import DEAD_REASON, STATUSES, Keys, key_slot
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, ClusterError, MasterDownError, TryAgainError

from bench.chaos.model import FORWARD, TERMINAL, UNDO, UNDO_TOOLS, Report

# What a poll meets while Redis restarts or a cluster fails over: look again on the next round.
REDIS_AWAY = (redis.ConnectionError, ClusterError, ClusterDownError, MasterDownError, TryAgainError)

# Watching Redis ---------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What Redis said about one workflow once it settled (taken before its retention expires)."""

    state: dict[str, str]
    comps: dict[str, dict[str, Any]]
    steps: int
    log: list[dict[str, str]]


class Tracker:
    """Reads the publishers' records as they are written and snapshots each workflow once it settles.

    A settled workflow (and a late change to it) lives only `retention` seconds, so the snapshots
    must be taken within that time whatever the run is doing: `start()` polls from a thread of its
    own. Polled only from the fault loop, it went blind while a fault blocked that loop (an MCP
    server or Redis restarting under load takes seconds) and reported as lost the steps a claim
    had recorded and retention had expired meanwhile.
    """

    def __init__(self, r: redis.Redis, keys: Keys, paths: list[Path]) -> None:
        self.r, self.keys, self.paths = r, keys, paths
        self.offsets = {p: 0 for p in paths}
        self.records: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, Snapshot] = {}
        # Later incarnations: workflow -> createdAt -> snapshot. Events of a workflow handled after
        # it expired (held by a coordinator paused or dead for longer than the retention) start a
        # new one (README, "Not promised"); it is not the workflow its orchestrator ran, so it never
        # replaces that one's snapshot, but a step recorded only there was recorded all the same.
        self.later: dict[str, dict[str, Snapshot]] = {}
        self.last_settled = time.monotonic()
        self.wipes: list[tuple[float, frozenset[str]]] = []  # (when Redis was back, who had settled before)
        # (SIGKILL of a cluster primary, cluster healthy again, the slots it served), wall clock.
        self.failovers: list[tuple[float, float, frozenset[int]]] = []
        self.lock = threading.RLock()  # the polling thread and the run's own calls share the fields above
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, every: float = 0.1) -> None:
        """Poll every `every` seconds in a daemon thread until `stop()`."""

        def loop() -> None:
            while not self._stop.wait(every):
                with contextlib.suppress(redis.RedisError):
                    self.poll()

        self._thread = threading.Thread(target=loop, name="chaos-tracker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wiped(self, began: float, ended: float) -> None:
        """Redis lost its data between `began` and `ended` (wall clock): remember who had settled by then."""
        with self.lock:
            self.wipes.append((ended, frozenset(self.snapshots)))

    def failed_over(self, began: float, ended: float, slots: set[int]) -> None:
        """A cluster primary serving `slots` was SIGKILLed at `began`; its replica served them from `ended`."""
        with self.lock:
            self.failovers.append((began, ended, frozenset(slots)))

    def failover_losses(self) -> dict[str, tuple[float, float, frozenset[int]]]:
        """Workflows a failover may have cost writes: workflow -> the failover.

        Redis replicates asynchronously and a cluster has no WAIT option here yet (README
        "Failover"), so what the killed primary acknowledged in its last moments and had not sent
        to its replica is gone: an event on its partition's stream, a commit or report in its
        slots. Only workflows whose own keys or whose partition's stream lived on that primary, and
        which were in flight when it died, can be touched by that. The verifier counts what such a
        workflow is missing as lost with the failover instead of flagging it; any other loss is a
        violation.
        """
        with self.lock:
            found = {}
            for workflow, record in self.records.items():
                slots = {key_slot(self.keys.state(workflow)), key_slot(self.keys.route(workflow).events)}
                for failover in self.failovers:
                    began, ended, served = failover
                    in_flight = record.get("started", 0.0) <= ended and record.get("ended", ended) >= began
                    if in_flight and slots & served:
                        found[workflow] = failover
            return found

    def lost(self) -> set[str]:
        """Workflows that had started and not settled (as far as was seen) when Redis lost its data."""
        with self.lock:
            return self._lost()

    def _lost(self) -> set[str]:
        return {
            w
            for w, rec in self.records.items()
            if any(w not in settled and rec.get("started", 0.0) < ended for ended, settled in self.wipes)
        }

    def read(self) -> None:
        for path in self.paths:
            if not path.exists():
                continue
            with path.open() as f:
                f.seek(self.offsets[path])
                while (line := f.readline()).endswith("\n"):
                    self.offsets[path] = f.tell()
                    record = json.loads(line)
                    self.records[record["workflow"]] = record

    def waiting(self) -> list[str]:
        """Workflows whose terminal event was published and which have not settled yet (nor were lost)."""
        with self.lock:
            lost = self._lost() if self.wipes else set()
            return [
                w
                for w, rec in self.records.items()
                if rec["terminalPublished"] and w not in self.snapshots and w not in lost
            ]

    def poll(self) -> None:
        with self.lock:
            self._poll()

    def _poll(self) -> None:
        self.read()
        self.follow_changes()
        waiting = self.waiting()
        if not waiting:
            return
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for workflow in waiting:
                    pipe.hget(self.keys.state(workflow), "status")
                statuses = pipe.execute()
            settled = [w for w, s in zip(waiting, statuses, strict=True) if s and s.decode() in TERMINAL]
            self.keep(self.snapshot(settled))
        except REDIS_AWAY:
            return  # Redis is restarting or failing over: look again on the next round
        if settled:
            self.last_settled = time.monotonic()

    def snapshot(self, workflows: list[str]) -> dict[str, Snapshot]:
        with self.r.pipeline(transaction=False) as pipe:
            for workflow in workflows:
                pipe.hgetall(self.keys.state(workflow))
                pipe.hgetall(self.keys.comp(workflow))
                pipe.llen(self.keys.steps(workflow))
                pipe.xrange(self.keys.log(workflow))
            replies = iter(pipe.execute())
        taken = {}
        for workflow in workflows:
            state, comps, steps, log = next(replies), next(replies), next(replies), next(replies)
            if not state:
                continue
            taken[workflow] = Snapshot(
                state={k.decode(): v.decode() for k, v in state.items()},
                comps={k.decode(): json.loads(v) for k, v in comps.items()},
                steps=steps,
                log=[{k.decode(): v.decode() for k, v in f.items()} for _, f in log],
            )
        return taken

    def keep(self, taken: dict[str, Snapshot]) -> None:
        """File fresh snapshots: the first settled incarnation of a workflow, or a later one apart."""
        for workflow, snap in taken.items():
            first = self.snapshots.get(workflow)
            created = snap.state.get("createdAt", "")
            if first is None or first.state.get("createdAt", "") == created:
                self.snapshots[workflow] = snap
            else:
                self.later.setdefault(workflow, {})[created] = snap

    def _known(self, workflow: str, created: str) -> Snapshot | None:
        first = self.snapshots[workflow]
        if first.state.get("createdAt", "") == created:
            return first
        return self.later.get(workflow, {}).get(created)

    def follow_changes(self) -> None:
        """Snapshot again the settled workflows that changed since (a step claimed from a killed
        coordinator can land on a completed workflow), before their retention runs out.

        A change is another version or another `createdAt`: events claimed after the workflow
        expired start a new one (README, "Not promised"), whose first version may be the same
        number; `keep` files it apart from the workflow the orchestrator ran.
        """
        names = list(self.snapshots)
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for workflow in names:
                    pipe.hmget(self.keys.state(workflow), ["version", "createdAt"])
                seen = pipe.execute()
            moved = []
            for w, (version, created) in zip(names, seen, strict=True):
                if version is None:
                    continue
                known = self._known(w, (created or b"").decode())
                if known is None or known.state.get("version") != version.decode():
                    moved.append(w)
            if moved:
                self.keep(self.snapshot(moved))
        except REDIS_AWAY:
            return  # Redis is restarting or failing over: look again on the next round

    def refresh(self) -> None:
        """Take the latest view of every snapshotted workflow still in Redis (a late event may have moved it)."""
        with self.lock:
            alive = [w for w in self.snapshots if self.r.exists(self.keys.state(w))]
            for i in range(0, len(alive), 200):
                self.keep(self.snapshot(alive[i : i + 200]))


def events_outstanding(r: Any, keys: Keys) -> int:
    """Entries of every partition's events stream the coordinators have not acknowledged, or not read yet."""
    outstanding = 0
    for part in keys.every():
        try:
            groups = r.xinfo_groups(part.events)
        except redis.ResponseError:
            continue
        outstanding += sum((g.get("pending") or 0) + (g.get("lag") or 0) for g in groups)
    return outstanding


def memory_of(r: Any, field: str) -> int:
    """An INFO memory field: of the one Redis, or summed over a cluster's primaries."""
    if isinstance(r, RedisCluster):
        found = r.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(info[field]) for info in found.values())
    return int(r.info("memory")[field])


def clients_now(r: Any) -> tuple[int, int]:
    """Connections and their memory (CLIENT LIST's tot-mem) at this moment: of the one Redis, or a cluster's primaries.

    INFO's `mem_clients_normal` is a sum that clientsCron brings up to date about once a second
    per client, so a connection opened or grown since (a pool that grew while the verifier ran,
    each ~38 kB with its buffers) is missing from it and shows up in `used_memory_dataset`
    instead; tot-mem is read from each client now.
    """
    nodes = [r.get_redis_connection(n) for n in r.get_primaries()] if isinstance(r, RedisCluster) else [r]
    listed = [c for node in nodes for c in node.client_list()]
    return len(listed), sum(int(c.get("tot-mem", 0)) for c in listed)


def distinct(r: Any, queue: Any) -> list[Any]:
    """The Redis servers behind `r` and `queue`, each once.

    On one Redis the run's two clients (events and RQ's queue) are two objects for one server:
    counting both summed every INFO figure twice, so the memory check compared twice the run's
    growth with RQ's records once (the 0.15-1.2 MB "overrun" of seed 20261201). The server's
    run_id tells them apart.
    """
    if queue is r:
        return [r]
    one = not isinstance(r, RedisCluster) and not isinstance(queue, RedisCluster)
    if one and r.info("server")["run_id"] == queue.info("server")["run_id"]:
        return [r]
    return [r, queue]


def memory_overrun(before: dict[str, Any], after: dict[str, Any], slack: int) -> str | None:
    """Whether memory came back: what the data grew by, against what is allowed to stay, or None.

    Allowed: RQ's own job records (kept an hour, or a week if failed) and mcp-saga's keys kept by
    design (the events streams and their group, outcomes and dead letters, capped by their
    `maxlen`, the index keys, the keys of workflows never signalled, kept until `idle_ttl`), each
    measured by MEMORY USAGE, plus `slack` for what the server keeps outside keys (tens of kB).
    The connections, scripts and the server's own overhead are not data: `footprint` names them.
    """
    grown = after["data"] - before["data"]
    kept = (after["rq_bytes"] - before["rq_bytes"]) + (after["saga_bytes"] - before["saga_bytes"])
    kept += after["other_bytes"] - before["other_bytes"]
    if grown <= kept + slack:
        return None
    return (
        f"Redis data grew by {grown} B after expiry, more than the {kept} B of keys it keeps "
        f"(RQ job records {after['rq_bytes']} B, mcp-saga's {after['saga_bytes']} B, other {after['other_bytes']} B) "
        f"+ slack {slack} B"
    )


def footprint(
    r: Any, keys: Keys, ignore: frozenset[str] = frozenset(), *, queue: redis.Redis | None = None
) -> dict[str, Any]:
    """Memory and keys: what "back to baseline" is measured with.

    `ignore` names workflows whose orchestrator never published a terminal event: they stay
    `running` until `idle_ttl`, as documented, so their keys are not expected to expire here.
    `queue` is RQ's Redis when it is not `r` (a cluster's): RQ's records are counted there, and
    memory on a cluster is the sum over its primaries.

    `data` is what the check compares: `used_memory` less the server's own overhead (start-up
    memory, the keyspace's hash tables, scripts, AOF buffer, replication backlog) and less the
    connections' memory as it is now (see `clients_now`). What is left is the keys' values and
    names plus a few tens of kB the server keeps outside keys (per-command latency histograms,
    the slow log, pub/sub channel names); the other parts are reported beside it, by name.
    """
    queue = r if queue is None else queue
    servers = distinct(r, queue)
    workflow_keys = 0
    for key in r.scan_iter(match=keys.workflow_pattern(), count=1000):
        tag = key.decode(errors="replace").partition("{")[2].rpartition("}")[0]
        workflow_keys += tag not in ignore
    rq_bytes = 0
    for key in queue.scan_iter(match="rq:*", count=1000):
        rq_bytes += queue.memory_usage(key, samples=0) or 0
    # Index and deadline entries of workflows expected gone (an unfinished one may have two: its
    # status and the deadline of an intent in doubt).
    indexed = sum(
        m.decode() not in ignore
        for k in keys.every()
        for key in [*(k.index(s) for s in STATUSES), k.deadlines]
        for m in r.zrange(key, 0, -1)
    )
    # Ours by key, per-workflow keys (those of `ignore`) summed under one name: what is kept by design
    # (the events streams with their group, the dead letters, the outcomes) is named with its size.
    ours: dict[str, int] = {}
    for key in r.scan_iter(match=f"{keys.prefix}:*", count=1000):
        name = key.decode(errors="replace")
        name = f"{keys.prefix}:{{workflow}}:*" if "{" in name and "}:" in name and ":index:" not in name else name
        ours[name] = ours.get(name, 0) + (r.memory_usage(key, samples=0) or 0)
    # Anything else (neither ours nor RQ's), by the first part of its name: a memory overrun says whose it is.
    other: dict[str, int] = {}
    for client in servers:
        for key in client.scan_iter(count=1000):
            name = key.decode(errors="replace")
            if not name.startswith((f"{keys.prefix}:", "rq:")):
                head = name.split(":", 1)[0]
                other[head] = other.get(head, 0) + (client.memory_usage(key, samples=0) or 0)
    slowlog = sum(len(client.slowlog_get(1024)) for client in servers if not isinstance(client, RedisCluster))
    # Redis 7 keeps a latency histogram (~25 kB) per command name ever run, which would count the
    # commands this run used, not its data: statistics only, reset just before the measurement.
    for client in servers:
        client.config_resetstat()
    connections, clients = 0, 0
    for client in servers:
        n, size = clients_now(client)
        connections, clients = connections + n, clients + size
    fields = ("used_memory", "used_memory_dataset", "used_memory_overhead", "mem_clients_normal", "used_memory_scripts")
    memory = {name: sum(memory_of(client, name) for client in servers) for name in fields}
    overhead = memory["used_memory_overhead"] - memory["mem_clients_normal"]
    return {
        "used_memory": memory["used_memory"],
        "data": memory["used_memory"] - overhead - clients,
        "dataset": memory["used_memory_dataset"],
        "overhead": overhead,
        "clients": clients,
        "connections": connections,
        "clients_counted": memory["mem_clients_normal"],
        "scripts": memory["used_memory_scripts"],
        "slowlog": slowlog,
        "saga_bytes": sum(ours.values()),
        "ours": dict(sorted(ours.items(), key=lambda kv: -kv[1])[:8]),
        "other_bytes": sum(other.values()),
        "other": dict(sorted(other.items(), key=lambda kv: -kv[1])[:5]),
        "keys": sum(keys_in(c) for c in servers),
        "workflow_keys": workflow_keys,
        "indexed": indexed,
        "rq_bytes": rq_bytes,
        "events": sum(r.xlen(k.events) for k in keys.every()),
        "dead_letters": sum(r.xlen(k.dead_letter) for k in keys.every()),
    }


def keys_in(r: Any) -> int:
    """DBSIZE: of the one Redis, or summed over a cluster's primaries (redis-py adds the replies up)."""
    if isinstance(r, RedisCluster):
        return int(r.dbsize(target_nodes=RedisCluster.PRIMARIES))
    return int(r.dbsize())


# Checking ---------------------------------------------------------------------------------------


def dead_letters(r: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    """Every dead-lettered entry: its type, workflow, step (when its data names one) and the reason."""
    entries = []
    for _, fields in r.xrange(keys.dead_letter):
        text = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
        step = ""
        with contextlib.suppress(ValueError, AttributeError):
            step = str(json.loads(text.get("data", "{}")).get("step", ""))
        entries.append({"type": text.get("type", ""), "workflow": text.get("workflow", ""), "step": step,
                        "reason": text.get(DEAD_REASON, "?")})  # fmt: skip
    return entries


def worker_log_events(workdir: Path) -> list[dict[str, Any]]:
    """The workers' JSON log lines about compensations (RQ's own plain lines are skipped)."""
    events = []
    for path in sorted(workdir.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"compensation ' in line:
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
    return events


def late_order(step_entry: str | None, completion_entry: str | None) -> str:
    """Where a step recorded after its workflow's completion stood in the stream, against the completion.

    "before": the stream had the step first and coordinators folded them out of order (the
    completion has no barrier: it carries no step count, and a completed workflow has nothing to
    undo); "after": the step's write reached the stream after the completion's; "unknown": an id
    is missing (a timeline of an older coordinator, or an entry cut from it).
    """
    if not step_entry or not completion_entry:
        return "unknown"
    with contextlib.suppress(ValueError):
        return "before" if stream_id(step_entry) < stream_id(completion_entry) else "after"
    return "unknown"


def verify(
    records: dict[str, dict[str, Any]],
    snapshots: dict[str, Snapshot],
    ledgers: dict[str, dict[str, Any]],
    worker_log: list[dict[str, Any]],
    dead: list[dict[str, str]],
    report: Report,
    crashed: list[tuple[str, str, float]] = (),  # type: ignore[assignment]
    lost: set[str] = frozenset(),  # type: ignore[assignment]
    failover: dict[str, Any] | None = None,
    later: dict[str, dict[str, Snapshot]] | None = None,
) -> None:
    """Every guarantee, checked against the servers' ledgers and the publishers' records.

    `lost` names the workflows in flight when Redis restarted without its data: mcp-saga cannot
    know of them any more, so their effects are counted as left in place, not flagged; the
    ledger-wide checks (one effect per key and per holding, nothing undone unpublished) still
    apply to them.
    `failover` names the workflows a cluster primary's SIGKILL may have cost writes
    (`Tracker.failover_losses`): an event or a state they miss is counted in `failover_lost`, each
    with its line in `failover_notes`, not flagged; every other check still applies to them.
    `later` holds the incarnations events started after a workflow expired (`Tracker.later`): a
    step recorded only there counts as recorded (in `restarted_steps`), every other check reads
    the workflow its orchestrator ran.
    """
    violations = report.violations
    failover = failover or {}
    later = later or {}
    report.restarted_workflows = len(later)

    def missing(workflow: str, events: int, what: str) -> None:
        """`events` published events of `workflow` that Redis does not reflect."""
        if workflow in failover:
            report.failover_lost += events
            report.failover_notes.append(f"{workflow}: {what}")
        else:
            report.lost_events += events
            violations.append(f"{workflow}: {what}")

    holdings: dict[str, tuple[str, dict[str, Any]]] = {}
    by_holding: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for server, ledger in ledgers.items():
        for holding in ledger["holdings"]:
            holdings[holding["id"]] = (server, holding)
        for effect in ledger["effects"]:
            by_holding[effect["holding"]].append(effect)
            if effect["tool"] in UNDO_TOOLS and effect["idempotencyKey"]:
                by_key[effect["idempotencyKey"]].append(effect)

    # Exactly once, from the ledgers alone: one undo per key, at most one undo per holding.
    for key, effects in by_key.items():
        if len(effects) > 1:
            report.double_effects += len(effects) - 1
            violations.append(f"idempotency key {key} applied {len(effects)} times: {effects}")
    for holding, effects in by_holding.items():
        undos = [e for e in effects if e["tool"] in UNDO_TOOLS]
        if len(undos) > 1 and len({e["idempotencyKey"] for e in undos}) > 1:
            report.double_effects += len(undos) - 1
            violations.append(f"holding {holding} undone {len(undos)} times under different keys")
        if any(not e["idempotencyKey"] for e in undos):
            violations.append(f"holding {holding} undone without an idempotency key")

    known: set[str] = set()
    statuses: Counter[str] = Counter()
    for workflow, record in sorted(records.items()):
        report.answers_lost += "lostAnswer" in record
        steps = record["steps"]
        known.update(s["holding"] for s in steps + record["unpublished"])
        report.steps += len(steps)
        if record["outcome"] == "completed":
            report.completed += 1
        else:
            report.failed += 1
        if workflow in lost:
            statuses["(lost with Redis's data)"] += 1
            report.wiped_workflows += 1
            report.wiped_effects += sum(
                1 for step in steps if not any(e["tool"] in UNDO_TOOLS for e in by_holding[step["holding"]])
            )
            continue
        if not record["terminalPublished"]:
            statuses["(terminal event not published)"] += 1
            continue
        snap = snapshots.get(workflow)
        if snap is None:
            missing(workflow, 1 + len(steps), f"no settled state in Redis ({record['outcome']}, {len(steps)} steps)")
            continue
        status = snap.state.get("status", "?")
        statuses[status] += 1
        recorded = snap.steps
        completion = next((e.get("entry") for e in snap.log if e.get("type") == "workflow-completed"), None)
        for step in steps:
            comp = snap.comps.get(step["step"])
            if comp is not None:
                # A step handled after another coordinator completed the workflow (claimed from a
                # killed one, or folded by a second healthy one whose batch committed later) is
                # recorded as such: in the history, nothing to undo. The stream ids say which.
                if "after the workflow completed" in (comp.get("reason") or ""):
                    report.late_steps += 1
                    order = late_order(comp.get("eventId"), completion)
                    report.late_order[order] = report.late_order.get(order, 0) + 1
                continue
            if any(step["step"] in again.comps for again in later.get(workflow, {}).values()):
                report.restarted_steps += 1  # handled after the workflow expired: a new incarnation has it
                continue
            missing(workflow, 1, f"step {step['step']} was published but is not recorded")
        published = {s["step"] for s in steps + record["unpublished"]}
        # Intents of calls the orchestrator saw fail (no answer, or an error one) are on the stack too.
        unconfirmed = [n for n, c in snap.comps.items() if c.get("forwardKey") or c.get("failedCall")]
        recorded -= sum(1 for name in unconfirmed if name not in published)
        if recorded > len(steps) + len(record["unpublished"]):
            violations.append(f"{workflow}: {recorded} steps recorded, only {len(steps)} published")

        if record["outcome"] == "completed":
            if status != "completed":
                missing(workflow, int(status == "running"), f"completed by its orchestrator, but {status} in Redis")
            for step in steps:
                undos = [e for e in by_holding[step["holding"]] if e["tool"] in UNDO_TOOLS]
                _, holding = holdings.get(step["holding"], ("", None))
                if undos or holding is None or holding["status"] != FORWARD[step["tool"]][2]:
                    violations.append(f"{workflow}: holding {step['holding']} of a completed workflow was touched")
            continue

        if status not in ("compensated", "needs-attention"):
            missing(workflow, int(status == "running"), f"failed, but left {status}")
            continue
        if status == "needs-attention":
            reason = snap.state.get("attention", "")
            report.attention[workflow] = reason
            if not reason.strip():
                violations.append(f"{workflow}: needs-attention without a reason")
        flagged = "never recorded" in snap.state.get("attention", "")
        if record["unpublished"] and not flagged and recorded < len(steps) + len(record["unpublished"]):
            violations.append(f"{workflow}: a step's event was not published, but nothing flags it")
        for step in steps:
            comp = snap.comps.get(step["step"])
            undos = [e for e in by_holding[step["holding"]] if e["tool"] in UNDO_TOOLS]
            server, holding = holdings.get(step["holding"], (step["server"], None))
            if comp is None:
                violations.append(f"{workflow}: step {step['step']} has no compensation record")
            elif comp["status"] == "succeeded":
                if len(undos) != 1:
                    violations.append(f"{workflow}: step {step['step']} succeeded, but {len(undos)} undo effects")
                elif undos[0]["idempotencyKey"] != comp["idempotencyKey"]:
                    violations.append(f"{workflow}: step {step['step']} was undone under another key")
                elif holding is None or holding["status"] != UNDO[server][1]:
                    violations.append(f"{workflow}: holding {step['holding']} is not {UNDO[server][1]}")
                else:
                    report.compensations += 1
            elif status == "compensated":
                violations.append(f"{workflow}: compensated, but step {step['step']} is {comp['status']}")
            elif undos:
                report.compensations += 1  # applied, its report lost: the record says what a human must check
            else:
                report.left_for_human += 1
        # LIFO, from the servers' clocks: each undo applied after those of every later step.
        applied = [(e["at"], int(step["step"][1:])) for step in steps for e in by_holding[step["holding"]]
                   if e["tool"] in UNDO_TOOLS]  # fmt: skip
        order = [index for _, index in sorted(applied)]
        if order != sorted(order, reverse=True):
            report.out_of_order += 1
            violations.append(f"{workflow}: steps undone in the order {order}, not last-first")
        for comp in snap.comps.values():
            dispatched = sum(1 for e in snap.log if e.get("type") == "compensation-dispatched"
                             and e.get("step") == comp["step"])  # fmt: skip
            report.dispatches += dispatched
            report.redispatches += max(0, dispatched - 1)
    report.statuses = dict(statuses)

    # Effects nobody confirmed: a call that failed at the client but ran at the server. With its
    # intent recorded (holdings name their workflow and step), each is undone or flagged in doubt.
    for holding, (_, entry) in holdings.items():
        if holding in known:
            continue
        ref = str(entry["data"].get("sku") or entry["data"].get("orderId") or "")
        workflow, _, index = ref.rpartition("/")
        snap = snapshots.get(workflow)
        comp = snap.comps.get(f"s{index}") if snap is not None else None
        if comp is not None and comp.get("inDoubt"):
            status = snap.state.get("status")  # type: ignore[union-attr]
            if any(e["tool"] in UNDO_TOOLS for e in by_holding[holding]):
                report.in_doubt_undone += 1
                continue
            if status == "needs-attention" and "in doubt" in snap.state.get("attention", ""):  # type: ignore[union-attr]
                report.in_doubt_flagged += 1
                continue
            violations.append(f"{workflow}: step s{index} was in doubt, its effect {holding} remains, nothing says so")
            continue
        if workflow in lost or not records.get(workflow, {}).get("terminalPublished", True):
            report.in_doubt_lost += 1
            continue
        report.unseen_effects += 1
        if any(e["tool"] in UNDO_TOOLS for e in by_holding[holding]):
            violations.append(f"holding {holding} was undone, but no orchestrator ever published it")

    # Repeats the key absorbed: successful calls beyond the first for one compensation.
    calls: Counter[tuple[str, str]] = Counter()
    for event in worker_log:
        msg = event.get("msg", "")
        if msg == "compensation succeeded":
            calls[(event.get("workflow", ""), event.get("step", ""))] += 1
        elif msg == "compensation skipped":
            report.duplicate_jobs_stopped += 1
        elif msg == "compensation failed":
            error = str(event.get("error", ""))
            if TRANSIENT_PREFIX in error:
                report.injected_errors += 1
            elif "Error executing tool" not in error:  # no answer: the server was restarting
                report.transport_errors += 1
    report.repeat_calls = sum(n - 1 for n in calls.values() if n > 1)

    # A worker that died between its call and its report: the call took effect (the ledger says so,
    # before the death), the compensation was dispatched again, and the key kept it to one effect.
    for workflow, step, died in crashed:
        comp = snapshots[workflow].comps.get(step) if workflow in snapshots else None
        effects = by_key.get(comp["idempotencyKey"], []) if comp else []
        if comp and comp["status"] == "succeeded" and len(effects) == 1 and effects[0]["at"] <= died:
            report.repeat_calls += 1
            report.crash_repeats += 1
