"""A primary, its replicas and a Sentinel, all real `redis-server` processes on loopback, for failover tests.

Tuned to fail over within a few seconds of a SIGKILL (`down-after-milliseconds` 1000, quorum 1 of
one sentinel): production runs three sentinels and longer timeouts, which change how long a
failover takes, not what the processes must do to follow it.

Each replica reaches the primary through a `Link`, a TCP relay that can stall like a partitioned
network: bytes the primary sent stay in the link, and are gone if the primary dies meanwhile.
That is how a replica falls behind in production (a slow or broken link); on a healthy loopback a
replica has every write within microseconds, and a kill almost never finds one it lacks.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from mcp_saga.cli.procs import free_port
from mcp_saga.cli.redis_server import RedisServer, find_redis_server
from processes import wait_for

MASTER = "mymaster"
HOST = "127.0.0.1"
SENTINEL_CONF = """port {port}
bind 127.0.0.1
dir {dir}
sentinel monitor {master} 127.0.0.1 {primary} 1
sentinel down-after-milliseconds {master} 1000
sentinel failover-timeout {master} 3000
sentinel parallel-syncs {master} 2
"""


class Link:
    """A relay for one replica's replication connection; `hold()` stalls both directions."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server((HOST, 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self.closed = threading.Event()
        self._lock = threading.Lock()
        # destination socket -> bytes held for it; a destination whose source died is dropped with them
        self._pending: dict[socket.socket, bytearray] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                downstream, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=2)
            except OSError:
                downstream.close()
                continue
            upstream.settimeout(None)
            for src, dst in ((upstream, downstream), (downstream, upstream)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with self._lock:
            self._pending[dst] = bytearray()
        try:
            while data := src.recv(65536):
                with self._lock:
                    if self.held.is_set():
                        self._pending[dst] += data
                        continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._pending.pop(dst, None)  # in flight when its sender died: lost, as on a real network
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def hold(self) -> None:
        self.held.set()

    def relaying(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def release(self) -> None:
        with self._lock:
            self.held.clear()
            for dst, data in self._pending.items():
                with contextlib.suppress(OSError):
                    dst.sendall(bytes(data))
                data.clear()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@dataclass
class SentinelGroup:
    """`nodes[0]` starts as primary; `url` is the `redis+sentinel://` URL every process is given."""

    directory: Path
    replicas: int = 2
    nodes: list[RedisServer] = field(default_factory=list)
    sentinel: subprocess.Popen[bytes] | None = None
    sentinel_port: int = field(default_factory=free_port)
    links: list[Link] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{MASTER}/0"

    def start(self) -> SentinelGroup:
        binary = find_redis_server()
        assert binary, "the suite needs a redis-server (see README)"
        # No 5 s wait before a diskless full sync (Redis's default): a replica is in sync at once.
        quick = ["--repl-diskless-sync-delay", "0"]
        primary = RedisServer(binary, directory=self._dir("node0"), extra=quick).start()
        self.nodes.append(primary)
        for n in range(1, self.replicas + 1):
            link = Link(primary.port)
            self.links.append(link)
            replica = RedisServer(
                binary, directory=self._dir(f"node{n}"), extra=[*quick, "--replicaof", f"{HOST} {link.port}"]
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
        if any(link.held.is_set() for link in self.links):  # held bytes die with their sender, not after
            wait_for(lambda: not any(link.relaying() for link in self.links), 10, "the links to see the primary die")
        return node

    @contextlib.contextmanager
    def links_held(self) -> Iterator[None]:
        """The first primary's replication links stall for the block (a partition between it and its replicas)."""
        for link in self.links:
            link.hold()
        try:
            yield
        finally:
            for link in self.links:
                link.release()

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
        for link in self.links:
            link.close()
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
