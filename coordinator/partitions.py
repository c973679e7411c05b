"""One coordinator process reading every partition: a read loop per partition, in threads.

Each partition is a stream with its own consumer group (schemas/keys.py), and one XREADGROUP
cannot span streams in different cluster slots, so a process runs one `Coordinator` per
partition, each blocking on its own stream. Several processes share each partition through its
consumer group, as they share the single stream of a one-partition deployment: no lease, no
rebalancing, and a process that dies has its pending entries claimed by the others.
`saga stats` lists each partition's consumers: who reads which. `--partition N` pins a
process to some partitions instead.

The loops are threads because the work is mostly waiting on Redis; a process stays within one
core, so more throughput comes from more processes (see bench/partitions.py).
"""

from __future__ import annotations

import signal
import threading

from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.runtime.collector import tune_gc
from mcp_saga.runtime.logs import get_logger
from mcp_saga.schemas.config import Config, ConfigError
from redis import Redis

log = get_logger("coordinator")


def run_partitions(
    redis: Redis,
    config: Config,
    name: str | None = None,
    *,
    queue: Redis | None = None,
    only: list[int] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT; re-raises what ended a partition's loop (the others stop too).

    `only` pins this process to some partitions (`saga coordinator --partition N`): coordinators
    sharing a partition's group also share its workflows, and two folding events of one workflow
    at once cost a compare-and-set retry; pinned ones never meet. A partition nobody reads waits
    (its lag grows in `saga stats`) until a coordinator for it starts.
    """
    count = config.redis.partitions
    parts = sorted(set(only)) if only else list(range(count))
    if not all(0 <= p < count for p in parts):
        raise ConfigError(f"--partition {parts}: the config has {count} partition(s), 0..{count - 1}")
    loops = [Coordinator(redis, config, name, partition=p, queue=queue) for p in parts]
    tune_gc()
    if len(loops) == 1:
        return loops[0].run()
    failed: list[BaseException] = []
    done = threading.Event()

    def stop(*_: object) -> None:
        for loop in loops:
            loop.stop()

    def serve(loop: Coordinator) -> None:
        try:
            loop.run()
        except BaseException as exc:
            failed.append(exc)
            log.error("a partition's loop ended on an error", partition=loop.keys.part, error=repr(exc))
        finally:
            done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads = [
        threading.Thread(target=serve, args=(loop,), name=f"partition-{loop.keys.part}", daemon=True) for loop in loops
    ]
    for thread in threads:
        thread.start()
    log.info("reading every partition", partitions=len(loops))
    while not all(loop.stopping for loop in loops):
        done.wait(1.0)  # wakes on a signal's stop too, within a second
        if failed:
            stop()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return 0
