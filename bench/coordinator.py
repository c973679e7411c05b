"""What the coordinator costs over the cheapest loop that records events, and what a step costs in memory.

    python -m bench.coordinator [--redis URL] [--workflows 500] [--steps 10] [--repeat 3]
                                [--profile [N]] [--json PATH]

(a) baseline: `XREADGROUP COUNT 100` then one `HSET` per event and the `XACK`, in a MULTI, over
    N pre-published step-completed events;
(b) one in-process `Coordinator` draining the same N events (about 1 KB each: arguments, a
    structuredContent result mirrored as text, SEP-3172 recovery), from `--workflows` workflows
    of `--steps` steps published interleaved, so each batch touches many workflows.
    Target: b / a >= 0.5.
(c) Redis memory per recorded step (MEMORY USAGE over each workflow's keys / its steps) against
    the step's JSON size. Target: <= 2x.
(d) keys left per workflow after retention expiry: workflows completed, compensated and idle
    under one-second retention, then `collect_garbage`. Target: none.

Both loops run against the same Redis in the same run, interleaved; each rate is the median of
`--repeat` drains. CPU per event of this process and of the Redis server during the drains is
printed beside them: on a shared machine it moves far less with the load than the rates do.
`--profile` drains twice more: once with the coordinator's stages timed (and the Redis server's
time per command from INFO commandstats), once under cProfile for its N costliest functions.
Without --redis a private redis-server is started and thrown away; with one, only keys under
the `saga-bench` prefix and `bench:` are touched.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.coordinator import consumer
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.runtime.collector import tune_gc
from mcp_saga.schemas.config import Config, parse_config
from mcp_saga.schemas.events import StepCompleted, WorkflowCompleted, WorkflowFailed, entry_fields
from mcp_saga.schemas.keys import STATUSES, Keys
from redis import Redis

from bench.table import Row, print_table

PREFIX = "saga-bench"
K = Keys(PREFIX)
BASE_STREAM = "bench:events"
BASE_GROUP = "bench"
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {
        "operationId": "release_inventory",
        "parameters": {
            "reservationId": "$response.body#/reservationId",
            "orderId": "$request.body#/orderId",
            "reason": "saga rollback of {$response.body#/reservationId}",
        },
    },
}


def step_event(workflow: str, n: int) -> StepCompleted:
    """A step-completed as the orchestrator SDK publishes it: about 1 KB of JSON."""
    body = {
        "reservationId": f"RSV-{workflow}-{n:04d}",
        "status": "reserved",
        "sku": f"SKU-{n % 97:05d}",
        "quantity": 1 + n % 5,
        "warehouse": "eu-west-1b",
        "expiresAt": "2026-11-02T10:15:00Z",
        "lines": [{"line": i, "sku": f"SKU-{(n + i) % 97:05d}", "qty": 1} for i in range(2)],
    }
    return StepCompleted(
        step=f"reserve-{n}",
        server="inventory",
        tool="reserve_inventory",
        arguments={
            "orderId": workflow,
            "sku": body["sku"],
            "quantity": body["quantity"],
            "warehouse": body["warehouse"],
            "customer": {"id": "cus_8f2a91", "tier": "gold", "country": "DE"},
        },
        result={
            "structuredContent": body,
            "content": [{"type": "text", "text": json.dumps(body, separators=(",", ":"))}],
            "isError": False,
        },
        recovery=RECOVERY,
        annotations={"destructiveHint": False, "idempotentHint": True},
        completed_at="2026-11-01T10:15:00.123456Z",
    )


def workload(workflows: int, steps: int) -> list[dict[str, bytes | str]]:
    """Every workflow's steps, published round-robin so that one batch spans many workflows."""
    names = [f"order-{w:05d}" for w in range(workflows)]
    return [entry_fields(wf, step_event(wf, n)) for n in range(steps) for wf in names]


def clean(redis: Redis) -> None:
    for pattern in (f"{PREFIX}*", "bench:*"):
        keys = list(redis.scan_iter(match=pattern, count=1000))
        for i in range(0, len(keys), 1000):
            redis.unlink(*keys[i : i + 1000])


def publish(redis: Redis, stream: str, entries: list[dict[str, bytes | str]]) -> None:
    for i in range(0, len(entries), 1000):
        pipe = redis.pipeline(transaction=False)
        for fields in entries[i : i + 1000]:
            pipe.xadd(stream, fields)  # type: ignore[arg-type]
        pipe.execute()


# (a) and (b) --------------------------------------------------------------------------------


def cpu_seconds(redis: Redis) -> tuple[float, float]:
    """CPU seconds used so far by this process and by the Redis server: figures the load on a
    shared machine moves far less than wall-clock rates."""
    info = redis.info("cpu")
    return time.process_time(), info["used_cpu_user"] + info["used_cpu_sys"]


def cpu_per_event(before: tuple[float, float], redis: Redis, events: int, into: list | None) -> None:
    """Append (client, Redis server) CPU microseconds per event since `before` to `into`."""
    if into is not None:
        after = cpu_seconds(redis)
        into.append(tuple((a - b) / events * 1e6 for a, b in zip(after, before, strict=True)))


def baseline_drain(redis: Redis, entries: list[dict[str, bytes | str]], cpu: list | None = None) -> float:
    """Events/s of the minimal consumer: read 100, one HSET each, XACK, all in one MULTI."""
    clean(redis)
    redis.xgroup_create(BASE_STREAM, BASE_GROUP, id="0", mkstream=True)
    publish(redis, BASE_STREAM, entries)
    done = 0
    before = cpu_seconds(redis)
    started = time.perf_counter()
    while done < len(entries):
        reply = redis.xreadgroup(BASE_GROUP, "base", {BASE_STREAM: ">"}, count=100, block=100)
        if not reply:
            continue
        batch = reply[0][1]
        pipe = redis.pipeline(transaction=True)
        for entry_id, fields in batch:
            pipe.hset(f"bench:{{{fields[b'workflow'].decode()}}}:steps", entry_id, fields[b"data"])
        pipe.xack(BASE_STREAM, BASE_GROUP, *[entry_id for entry_id, _ in batch])
        pipe.execute()
        done += len(batch)
    rate = len(entries) / (time.perf_counter() - started)
    cpu_per_event(before, redis, len(entries), cpu)
    return rate


def coordinator(redis: Redis, config: Config) -> Coordinator:
    coord = Coordinator(redis, config, name="bench")
    coord.ensure_group()
    return coord


def coordinator_drain(
    redis: Redis,
    entries: list[dict[str, bytes | str]],
    config: Config,
    profile: cProfile.Profile | None = None,
    cpu: list | None = None,
) -> float:
    """Events/s of one in-process coordinator over the same events, from a cold start on them."""
    clean(redis)
    coord = coordinator(redis, config)
    publish(redis, K.events, entries)
    done = 0
    if profile:
        profile.enable()
    before = cpu_seconds(redis)
    started = time.perf_counter()
    while done < len(entries):
        done += coord.step().events
    elapsed = time.perf_counter() - started
    cpu_per_event(before, redis, len(entries), cpu)
    if profile:
        profile.disable()
    pending = redis.xpending(K.events, K.group)["pending"]
    assert pending == 0, f"{pending} events left unacknowledged"
    return len(entries) / elapsed


# (c) memory and (d) retention --------------------------------------------------------------


def workflow_names(redis: Redis) -> Iterator[str]:
    for key in redis.scan_iter(match=f"{PREFIX}:{{*}}:state", count=1000):
        yield key.decode()[len(PREFIX) + 2 : -len("}:state")]


def memory_per_step(redis: Redis, entries: list[dict[str, bytes | str]]) -> dict[str, float]:
    """Bytes per recorded step, by key kind, over every workflow the last drain recorded."""
    by_kind = {"state": 0, "steps": 0, "comp": 0, "log": 0}
    steps = 0
    for wf in workflow_names(redis):
        pipe = redis.pipeline(transaction=False)
        for kind in by_kind:
            pipe.memory_usage(getattr(K, kind)(wf), samples=0)
        pipe.hget(K.state(wf), "steps")
        *sizes, count = pipe.execute()
        for kind, size in zip(by_kind, sizes, strict=True):
            by_kind[kind] += size or 0
        steps += int(count)
    json_bytes = statistics.fmean(len(e["data"]) for e in entries)
    return {
        "json": json_bytes,
        "total": sum(by_kind.values()) / steps,
        **{kind: size / steps for kind, size in by_kind.items()},
    }


def keys_left_after_retention(redis: Redis, workflows: int) -> tuple[float, list[str]]:
    """Keys per workflow, and global keys, left once every workflow's retention has run out."""
    clean(redis)
    config = parse_config(
        {
            "prefix": PREFIX,
            "coordinator": {
                "block_ms": 5,
                "retention_completed": 1,
                "retention_compensated": 1,
                "retention_attention": 1,
                "idle_ttl": 1,
            },
        }
    )
    coord = coordinator(redis, config)
    entries = []
    for w in range(workflows):
        wf = f"ret-{w:05d}"
        plain = StepCompleted(step="s1", server="inventory", tool="lookup", result={"structuredContent": {"ok": True}})
        entries.append(entry_fields(wf, plain))
        if w % 3 == 0:
            entries.append(entry_fields(wf, WorkflowCompleted()))
        elif w % 3 == 1:  # nothing to undo (no recovery): compensated at once
            entries.append(entry_fields(wf, WorkflowFailed(reason="bench")))
        # else: left running, expires by its idle TTL
    publish(redis, K.events, entries)
    done = 0
    while done < len(entries):
        done += coord.step().events
    deadline = time.monotonic() + 10
    while any(True for _ in workflow_names(redis)) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.2)
    for _ in range(20):  # collect_garbage walks each index a slice at a time
        coord.store.collect_garbage()
    coord.trim_events()
    per_workflow = sum(1 for _ in redis.scan_iter(match=f"{PREFIX}:{{*", count=1000)) / workflows
    index_left = sum(redis.zcard(K.index(s)) for s in STATUSES) + redis.zcard(K.deadlines)
    globals_left = sorted(k.decode() for k in redis.scan_iter(match=f"{PREFIX}*", count=1000))
    if index_left:
        globals_left.append(f"({index_left} index entries)")
    return per_workflow, globals_left


# Profile ----------------------------------------------------------------------------------


def breakdown(redis: Redis, entries: list[dict[str, bytes | str]], config: Config) -> dict[str, Any]:
    """Wall time per event in each stage of a batch, and Redis server time per event by command.

    Stages are timed by wrapping the coordinator's own methods on one instance (no profiler, so
    the shares are not distorted); server time is the delta of INFO commandstats over the drain.
    """
    clean(redis)
    coord = coordinator(redis, config)
    publish(redis, K.events, entries)
    spent: dict[str, float] = defaultdict(float)

    def timed(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - started

        return wrapper

    stages = [
        (coord, "_read", "read: XREADGROUP"),
        (consumer, "decode_entry", "decode: decode_entry"),
        (coord.store, "load", "load: HGETALL state + HMGET comp"),
        (coord.machine, "apply", "fold: Machine.apply (planning)"),
        (coord.store, "commit", "commit: EVALSHA apply.lua"),
        (coord, "_dispatch", "dispatch: RQ enqueue"),
        (coord.store, "record_steps", "record: EVALSHA record_steps.lua"),
        (coord.store, "follow_up", "follow-up: index.lua, outcomes, dead letters"),
        (coord.store, "settle", "settle: outbox LREM + XACK"),
    ]
    original = consumer.decode_entry
    for owner, name, stage in stages:
        setattr(owner, name, timed(stage, getattr(owner, name)))
    before = redis.info("commandstats")
    done = 0
    started = time.perf_counter()
    try:
        while done < len(entries):
            done += coord.step().events
    finally:
        consumer.decode_entry = original  # type: ignore[attr-defined]
    total = time.perf_counter() - started
    after = redis.info("commandstats")
    server = {
        name.removeprefix("cmdstat_"): (stat["usec"] - before.get(name, {}).get("usec", 0)) / len(entries)
        for name, stat in after.items()
    }
    client = {stage: spent[stage] / len(entries) * 1e6 for _, _, stage in stages}
    client["other: step loop, logging"] = total / len(entries) * 1e6 - sum(client.values())
    return {
        "events_per_s": len(entries) / total,
        "client_us": client,
        "server_us": {k: v for k, v in sorted(server.items(), key=lambda kv: -kv[1]) if v > 0.05},
    }


# What apply.lua calls: INFO commandstats counts them both on their own and inside evalsha's time.
IN_SCRIPT = frozenset({"hget", "hset", "rpush", "xadd", "expire"})


def print_breakdown(found: dict[str, Any]) -> None:
    total = sum(found["client_us"].values())
    print(f"\nwhere a drain's time goes ({found['events_per_s']:,.0f} events/s, {total:.0f} us per event):")
    for stage, usec in found["client_us"].items():
        print(f"  {stage:40} {usec:7.1f} us/event {usec / total:6.1%}")
    server = found["server_us"]
    own = sum(usec for command, usec in server.items() if command not in IN_SCRIPT)
    print(f"Redis server time, {own:.1f} us per event (* = run inside evalsha and counted in it):")
    for command, usec in server.items():
        print(f"  {command + (' *' if command in IN_SCRIPT else ''):40} {usec:7.1f} us/event")


def hotspots(profile: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# Main -------------------------------------------------------------------------------------


def measure(url: str, workflows: int, steps: int, repeat: int, profile_top: int) -> tuple[list[Row], dict[str, Any]]:
    redis = Redis.from_url(url)
    tune_gc()  # as `saga coordinator` does at start (the baseline loop allocates next to nothing)
    try:
        entries = workload(workflows, steps)
        config = parse_config({"prefix": PREFIX, "coordinator": {"block_ms": 5}})
        bases, coords, base_cpu, coord_cpu = [], [], [], []  # interleaved: ABAB, so both meet the same load
        for _ in range(repeat):
            bases.append(baseline_drain(redis, entries, base_cpu))
            coords.append(coordinator_drain(redis, entries, config, cpu=coord_cpu))
        base, coord = statistics.median(bases), statistics.median(coords)
        client = statistics.median(c for c, _ in coord_cpu), statistics.median(c for c, _ in base_cpu)
        server = statistics.median(s for _, s in coord_cpu), statistics.median(s for _, s in base_cpu)
        memory = memory_per_step(redis, entries)  # of the last coordinator drain
        left, globals_left = keys_left_after_retention(redis, min(workflows, 300))
        extra: dict[str, Any] = {
            "events": len(entries),
            "memory_by_key": memory,
            "global_keys_after_retention": globals_left,
            "redis": redis.info("server")["redis_version"],
        }
        if profile_top:
            extra["breakdown"] = breakdown(redis, entries, config)
            profile = cProfile.Profile()
            coordinator_drain(redis, entries, config, profile)
            extra["profile"] = hotspots(profile, profile_top)
        clean(redis)
    finally:
        redis.close()
    rows = [
        Row("(a) baseline loop, events/s", base, None, "", None),
        Row("(b) coordinator, events/s", coord, base, "b/a >= 0.5", coord / base >= 0.5),
        Row("(b) coordinator CPU, us/event", client[0], client[1], "(a's in baseline)", None),
        Row("(b) Redis server CPU, us/event", server[0], server[1], "(a's in baseline)", None),
        Row("(c) bytes/step vs JSON", memory["total"], memory["json"], "<= 2", memory["total"] <= 2 * memory["json"]),
        Row("(d) keys/workflow after expiry", left, None, "0", left == 0),
    ]
    return rows, extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coordinator", description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    parser.add_argument("--workflows", type=int, default=500)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="drains per rate; the median is reported")
    parser.add_argument("--profile", type=int, nargs="?", const=25, default=0, metavar="N",
                        help="profile one more coordinator drain and print its N costliest functions")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    with resolve_redis(args.redis) as url:
        rows, extra = measure(url, args.workflows, args.steps, args.repeat, args.profile)
    memory = extra["memory_by_key"]
    print_table(rows, f"coordinator: {extra['events']:,} step-completed events, Redis {extra['redis']}")
    print(
        f"bytes per step: state {memory['state']:.0f}, steps {memory['steps']:.0f}, comp {memory['comp']:.0f}, "
        f"log {memory['log']:.0f} (total {memory['total']:.0f}) for {memory['json']:.0f} bytes of step JSON"
    )
    print(f"global keys left after retention: {', '.join(extra['global_keys_after_retention']) or 'none'}")
    if "profile" in extra:
        print_breakdown(extra["breakdown"])
        print(extra["profile"])
    if args.json:
        payload = {"rows": [row.as_dict() for row in rows], **{k: v for k, v in extra.items() if k != "profile"}}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
