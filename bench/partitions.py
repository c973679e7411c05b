"""Coordinator ingest on a real local Redis Cluster: 1 vs 3 partitions, one and two coordinators.

    python -m bench.partitions [--workflows 2000] [--steps 3] [--repeat 1] [--json PATH]

A cluster of three primaries and three replicas (`redis-server --cluster-enabled yes`, as the
tests start it) and a standalone Redis for RQ's queue are started on this machine. Each setting
publishes `--workflows` workflows of `--steps` step-completed events (about 1 KB each, the
coordinator benchmark's) and a workflow-completed, routed to their partitions by the SDK's
publisher, and times `saga coordinator` processes (started beforehand, every one reading every
partition) until every workflow's completion outcome is written. The baseline is the same drain
by one coordinator on one standalone Redis, measured in the same run. Rows: events per second,
and the ratio against that baseline. What the figures mean for sizing is in the README, "Running
on Redis Cluster".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mcp_saga.cli.procs import saga_process, stop_all, wait_for
from mcp_saga.cli.redis_server import LocalCluster, RedisServer, find_redis_server
from mcp_saga.runtime.connect import connect
from mcp_saga.runtime.publish import Publisher
from mcp_saga.schemas.config import Config, parse_config, write_config
from mcp_saga.schemas.events import WorkflowCompleted, entry_fields

from bench.coordinator import step_event
from bench.table import Row, print_table


def publish(config: Config, url: str, workflows: int, steps: int) -> int:
    """Every workflow's steps then its completion, interleaved, pipelined per partition's stream."""
    client = connect(url, config.redis)
    route = Publisher(client, config.prefix, config.redis.partitions)
    names = [f"order-{w:05d}" for w in range(workflows)]
    entries = [(wf, entry_fields(wf, step_event(wf, n))) for n in range(steps) for wf in names]
    entries += [(wf, entry_fields(wf, WorkflowCompleted())) for wf in names]
    for start in range(0, len(entries), 2000):
        pipe = client.pipeline(transaction=False)
        for wf, fields in entries[start : start + 2000]:
            pipe.xadd(route.stream_for(wf), fields)
        pipe.execute()
    client.close()
    return len(entries)


def completed(config: Config, url: str) -> int:
    client = connect(url, config.redis)
    try:
        return sum(client.xlen(part.outcomes) for part in config.keys().every())
    finally:
        client.close()


def readers(config: Config, url: str) -> int:
    """How many (partition, coordinator) pairs have joined: all are in when it is partitions x coordinators."""
    client = connect(url, config.redis)
    try:
        found = 0
        for part in config.keys().every():
            with contextlib.suppress(Exception):
                found += len(client.xinfo_consumers(part.events, part.group))
        return found
    finally:
        client.close()


def drain(
    url: str,
    redis: dict[str, object],
    coordinators: int,
    workflows: int,
    steps: int,
    workdir: Path,
    flush: object,
    pinned: bool = False,
) -> float:
    """Events per second that `coordinators` processes ingest with this `[redis]` table.

    `pinned`: coordinator n reads only partition n (`--partition n`), else each reads them all.
    """
    flush()  # type: ignore[operator]
    config = parse_config({"redis": redis, "coordinator": {"block_ms": 100}})
    path = write_config(config, workdir / "bench.toml")
    procs = [
        saga_process(
            "coordinator",
            "--name",
            f"c{n}",
            *(("--partition", str(n)) if pinned else ()),
            redis_url=url,
            config=path,
            log=workdir / f"c{n}.log",
        )
        for n in range(coordinators)
    ]
    try:
        want = config.redis.partitions if pinned else config.redis.partitions * coordinators
        wait_for(lambda: readers(config, url) >= want, timeout=60, what="coordinators joining every partition")
        started = time.perf_counter()
        events = publish(config, url, workflows, steps)
        wait_for(lambda: completed(config, url) >= workflows, timeout=600, what="every workflow completed")
        return events / (time.perf_counter() - started)
    finally:
        stop_all(*procs)


@contextlib.contextmanager
def servers() -> Iterator[tuple[LocalCluster, RedisServer, RedisServer]]:
    binary = find_redis_server()
    if binary is None:
        raise SystemExit("no redis-server: apt-get install redis-server")
    cluster = LocalCluster(binary, node_timeout_ms=5000).start()
    queue, single = RedisServer(binary).start(), RedisServer(binary).start()
    try:
        yield cluster, queue, single
    finally:
        for server in (single, queue):
            server.cleanup()
        cluster.cleanup()


def run(workflows: int, steps: int, repeat: int) -> list[Row]:
    import redis as redis_py
    from redis.cluster import RedisCluster

    with servers() as (cluster, queue, single), tempfile.TemporaryDirectory(prefix="saga-bench-") as tmp:
        workdir = Path(tmp)

        def flush_cluster() -> None:
            with RedisCluster.from_url(cluster.url) as c:
                c.flushall()
            with redis_py.Redis.from_url(queue.url) as q:
                q.flushall()

        def flush_single() -> None:
            with redis_py.Redis.from_url(single.url) as s:
                s.flushall()

        def median(url: str, table: dict[str, object], coordinators: int, flush: object, pinned: bool = False) -> float:
            runs = [drain(url, table, coordinators, workflows, steps, workdir, flush, pinned) for _ in range(repeat)]
            return statistics.median(runs)

        base = median(single.url, {}, 1, flush_single)
        on_cluster = {"cluster": True, "queue_url": queue.url}
        rows = [Row("ingest, 1 coordinator, 1 standalone Redis (events/s)", base, None, "baseline", None)]
        figures = {}
        for partitions, coordinators in ((1, 1), (1, 2), (3, 1), (3, 2)):
            table = {**on_cluster, "partitions": partitions}
            figures[(partitions, coordinators)] = rate = median(cluster.url, table, coordinators, flush_cluster)
            name = f"ingest, cluster, {partitions} partition(s), {coordinators} coordinator(s) (events/s)"
            rows.append(Row(name, rate, base, "measured", None))
        pinned = median(cluster.url, {**on_cluster, "partitions": 3}, 3, flush_cluster, pinned=True)
        name = "ingest, cluster, 3 partitions, 3 coordinators, one partition each (events/s)"
        rows.append(Row(name, pinned, base, "measured", None))
        gain = figures[(3, 2)] / figures[(1, 2)]
        rows.append(
            Row("3 vs 1 partitions, two coordinators (ratio)", gain, None, "> 1: partitions spread the work", gain > 1)
        )
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.partitions", description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = run(args.workflows, args.steps, args.repeat)
    print_table(
        rows, f"coordinator ingest on a local Redis Cluster ({args.workflows} workflows x {args.steps + 1} events)"
    )
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
