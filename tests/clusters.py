"""A real Redis Cluster for the tests: 3 primaries + 3 replicas, and a standalone Redis for RQ's queue.

`cluster_setup()` is what the `redis_cluster` fixture (tests/conftest.py, one per test module)
yields; the failover tests kill its nodes (`setup.cluster.nodes[i].stop(kill=True)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from mcp_saga.cli.redis_server import LocalCluster, RedisServer, find_redis_cli, find_redis_server
from redis.cluster import RedisCluster


@dataclass
class ClusterSetup:
    cluster: LocalCluster
    queue: RedisServer

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def queue_url(self) -> str:
        return self.queue.url

    def redis_settings(self, partitions: int = 3, **more: Any) -> dict[str, Any]:
        """The `[redis]` table of a config for this cluster."""
        return {"cluster": True, "queue_url": self.queue_url, "partitions": partitions, **more}

    def client(self) -> RedisCluster:
        return RedisCluster.from_url(self.url)

    def primary_of(self, key: str) -> RedisServer:
        """The node process serving `key` now (what a failover test kills to take its slot's primary away)."""
        with contextlib.closing(self.client()) as client:
            port = client.get_node_from_key(key).port
        return next(node for node in self.cluster.nodes if node.port == int(port))

    def flush(self) -> None:
        """Empty every primary and the queue: each test starts from nothing."""
        with contextlib.closing(self.client()) as client:
            client.flushall()
        import redis

        with redis.Redis.from_url(self.queue_url) as queue:
            queue.flushall()


@contextlib.contextmanager
def cluster_setup(primaries: int = 3, replicas: int = 1) -> Iterator[ClusterSetup]:
    binary = find_redis_server()
    if binary is None or find_redis_cli(binary) is None:
        pytest.skip("redis-server and redis-cli are needed for a local Redis Cluster")
    cluster = LocalCluster(binary, primaries=primaries, replicas=replicas).start()
    queue = RedisServer(binary)
    try:
        queue.start()
        yield ClusterSetup(cluster, queue)
    finally:
        queue.cleanup()
        cluster.cleanup()
