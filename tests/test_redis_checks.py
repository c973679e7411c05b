"""The Redis underneath: an evicting policy is refused at start-up, no persistence is said loudly.

Each test runs its own redis-server (the session's shared one must keep its settings) and real
`saga` processes against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from mcp_saga.cli.redis_server import RedisServer
from mcp_saga.runtime.redis_checks import inspect_redis
from mcp_saga.schemas.config import Config, RedisSettings, ServerConfig, write_config
from processes import REPO, saga_process, stop, wait_for


def _saga(*args: str, url: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mcp_saga.cli", *args, "--redis", url]
    if config is not None:
        command += ["--config", str(config)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_an_evicting_policy_stops_the_coordinator_unless_allowed(private_redis: RedisServer, tmp_path: Path) -> None:
    client = redis.Redis.from_url(private_redis.url)
    client.config_set("maxmemory-policy", "allkeys-lru")
    refused = _saga("coordinator", url=private_redis.url)
    assert refused.returncode == 2, refused.stderr
    assert "maxmemory-policy is 'allkeys-lru'" in refused.stderr and "allow_eviction" in refused.stderr
    assert not client.exists("saga:events"), "a refused coordinator creates nothing"
    servers = write_config(Config(servers={"p": ServerConfig(url="http://127.0.0.1:9/mcp")}), tmp_path / "w.toml")
    worker = _saga("worker", "--burst", url=private_redis.url, config=servers)
    assert worker.returncode == 2 and "maxmemory-policy is 'allkeys-lru'" in worker.stderr, worker.stderr

    allowed = write_config(Config(redis=RedisSettings(allow_eviction=True)), tmp_path / "saga.toml")
    log = tmp_path / "coordinator.log"
    coordinator = saga_process("coordinator", redis_url=private_redis.url, config=allowed, log=log)
    try:
        wait_for(lambda: client.exists("saga:events"), 20, "the coordinator to create its group")
        assert coordinator.poll() is None
    finally:
        assert stop(coordinator) == 0
    text = log.read_text()
    assert "may evict keys" in text and "REDIS HAS NO PERSISTENCE" in text


def test_saga_stats_shows_policy_and_persistence(private_redis: RedisServer) -> None:
    client = redis.Redis.from_url(private_redis.url)
    done = _saga("stats", "--json", url=private_redis.url)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)["redis"]
    assert facts["evictionPolicy"] == "noeviction" and facts["persistence"] == "none"
    client.config_set("appendonly", "yes")
    assert inspect_redis(client).persistence == "aof"
    table = _saga("stats", url=private_redis.url)
    assert "noeviction" in table.stdout and "aof" in table.stdout


@pytest.mark.parametrize(
    ("reply", "condition"),
    [
        ("CLUSTERDOWN The cluster is down", "CLUSTERDOWN"),
        ("TRYAGAIN Multiple keys request during rehashing of slot", "TRYAGAIN"),
        ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", "MASTERDOWN"),
        ("WRONGTYPE Operation against a key holding the wrong kind of value", None),
    ],
)
def test_a_cluster_failing_over_is_waited_out(reply: str, condition: str | None) -> None:
    """redis-py turns these replies into classes of their own and strips the prefix: the class is what says
    that a cluster between a primary's death and its replica's promotion is a condition that heals."""
    from mcp_saga.runtime.redis_checks import healing_condition
    from redis._parsers.base import BaseParser

    error = BaseParser.parse_error(reply)
    assert healing_condition(error) == condition, (type(error).__name__, str(error))
