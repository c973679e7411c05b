"""A primary, its replicas and a Sentinel, all real `redis-server` processes on loopback, for failover tests.

Tuned to fail over within about a second of a SIGKILL (`down-after-milliseconds` 300, quorum 1 of
one sentinel): production runs three sentinels and longer timeouts, which change how long a
failover takes, not what the processes must do to follow it.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from mcp_saga.cli.procs import free_port
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from processes import wait_for

MASTER = "mymaster"
SENTINEL_CONF = """port {port}
bind 127.0.0.1
dir {dir}
sentinel monitor {master} 127.0.0.1 {primary} 1
sentinel down-after-milliseconds {master} 1000
sentinel failover-timeout {master} 3000
sentinel parallel-syncs {master} 2
"""


@dataclass
class SentinelGroup:
    """`nodes[0]` starts as primary; `url` is the `redis+sentinel://` URL every process is given."""

    directory: Path
    replicas: int = 2
    nodes: list[RedisServer] = field(default_factory=list)
    sentinel: subprocess.Popen[bytes] | None = None
    sentinel_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{MASTER}/0"

    def start(self) -> SentinelGroup:
        binary = find_redis_server()
        assert binary, "the suite needs a redis-server (see README)"
        # No 5 s wait before a diskless full sync (Redis's default): a replica is in sync at once.
        quick = ("--repl-diskless-sync-delay", "0")
        primary = RedisServer(binary, directory=self._dir("node0"), extra_args=quick).start()
        self.nodes.append(primary)
        for n in range(1, self.replicas + 1):
            replica = RedisServer(
                binary, directory=self._dir(f"node{n}"), extra_args=(*quick, "--replicaof", f"127.0.0.1 {primary.port}")
            )
            self.nodes.append(replica.start())
        for node in self.nodes[1:]:
            wait_for(lambda n=node: _info(n.port).get("master_link_status") == "up", 30, "replicas in sync")
        conf = self._dir("sentinel") / "sentinel.conf"
        conf.write_text(
            SENTINEL_CONF.format(port=self.sentinel_port, dir=conf.parent, master=MASTER, primary=primary.port)
        )
        log = open(conf.parent / "sentinel.log", "ab")  # noqa: SIM115 - owned by the child
        self.sentinel = subprocess.Popen(
            [binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        sentinel = redis.Redis(port=self.sentinel_port)
        wait_for(lambda: _sentinel_sees(sentinel, self.replicas), 30, "the sentinel to see every replica")
        sentinel.close()
        return self

    def _dir(self, name: str) -> Path:
        path = self.directory / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def primary_port(self) -> int:
        sentinel = redis.Redis(port=self.sentinel_port)
        try:
            return int(sentinel.sentinel_get_master_addr_by_name(MASTER)[1])
        finally:
            sentinel.close()

    def primary(self) -> RedisServer:
        port = self.primary_port()
        return next(node for node in self.nodes if node.port == port)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary; returns it. Nothing is flushed: what it had not sent is lost."""
        node = self.primary()
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(10)
        return node

    def wait_for_promotion(self, old: RedisServer, timeout: float = 30) -> RedisServer:
        """The replica Sentinel promoted, once it accepts writes and (if any is left) has a replica again."""
        wait_for(lambda: self.primary_port() != old.port, timeout, "the sentinel to promote a replica")
        new = self.primary()
        left = sum(1 for n in self.nodes if n is not old and n is not new)
        wait_for(lambda: _info(new.port).get("role") == "master", timeout, "the promoted replica to take writes")
        if left:
            wait_for(lambda: _good_replicas(new.port) >= left, timeout, "the other replicas to follow the new primary")
        return new

    def sentinel_log(self) -> str:
        path = self.directory / "sentinel" / "sentinel.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            self.sentinel.kill()
            self.sentinel.wait(10)
        for node in self.nodes:
            node.cleanup()


def _info(port: int) -> dict:
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2)
    try:
        return client.info("replication")
    except redis.RedisError:
        return {}
    finally:
        client.close()


def _good_replicas(port: int) -> int:
    info = _info(port)
    return sum(
        1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
    )


def _sentinel_sees(sentinel: redis.Redis, replicas: int) -> bool:
    try:
        found = sentinel.sentinel_slaves(MASTER)
    except redis.RedisError:
        return False
    return sum(1 for r in found if not r.get("is_sdown") and not r.get("is_odown")) >= replicas


@contextlib.contextmanager
def sentinel_group(directory: Path, replicas: int = 2) -> Iterator[SentinelGroup]:
    group = SentinelGroup(directory, replicas)
    try:
        yield group.start()
    finally:
        group.stop()
