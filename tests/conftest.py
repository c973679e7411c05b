"""Shared fixtures: a real redis-server for integration tests, fakeredis for unit tests of logic."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from mcp_saga.cli.redis_server import RedisServer, find_redis_server, resolve_redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One real server for the session (`REDIS_URL` when set, else a private redis-server)."""
    with resolve_redis(os.environ.get("SAGA_TEST_REDIS_URL")) as url:
        yield url


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own (no AOF, no RDB): for settings the shared one must keep, and
    for tests that must not meet what earlier tests' processes left behind (RQ's scheduler lock)."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    """A clean database per test on the real server."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[object]:
    """A real Redis Cluster (3 primaries, 3 replicas) plus a standalone Redis for RQ, once per module
    (tests/clusters.py: `ClusterSetup`; call `.flush()` between tests that need an empty one)."""
    from clusters import cluster_setup

    with cluster_setup() as setup:
        yield setup
