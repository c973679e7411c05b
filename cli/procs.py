"""Child processes mcp-saga starts itself: example MCP servers and `saga` processes.

`saga demo`, the benchmarks, the chaos run and the tests all start their processes through
here, so a process is always waited for until it serves and always stopped, killed if need be.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, TypeVar

from mcp import StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
T = TypeVar("T")


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the OS picks it, so parallel runs do not clash)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def saga_process(
    *args: str,
    redis_url: str,
    config: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """`saga ARGS...` as its own process, its output appended to `log` (or discarded)."""
    full_env = {**os.environ, "REDIS_URL": redis_url, "SAGA_LOG": "text", **(env or {})}
    if config is not None:
        full_env["SAGA_CONFIG"] = str(config)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "mcp_saga.cli", *args],
            cwd=REPO,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


# How long a server may take to start listening. A dead one fails at once (its exit is seen), so this
# only has to outlast a slow start: Python + mcp imports alone took 6 s on this 2-core box under load.
START_TIMEOUT = 60.0


def stdio_params(module: str, *args: str, env: Mapping[str, str] | None = None) -> StdioServerParameters:
    """Parameters for `Client(...)` that spawn `python -m module *args` from the repository root."""
    return StdioServerParameters(command=sys.executable, args=["-m", module, *args], env=dict(env or {}), cwd=str(REPO))


def wait_until_accepting(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT) -> None:
    """Block until `host:port` accepts connections; fail early, with the server's stderr, if it dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before accepting connections")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing accepted connections on {host}:{port} within {timeout} s")


@contextmanager
def start_http_server(
    module: str, *args: str, env: Mapping[str, str] | None = None, host: str = HOST, timeout: float = START_TIMEOUT
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run `python -m module --http PORT --host HOST *args`; yield the process and its `/mcp` URL.

    The server is killed on exit whatever happened.
    """
    with start_http_servers((module, *args), env=env, host=host, timeout=timeout) as [started]:
        yield started


@contextmanager
def start_http_servers(
    *specs: Sequence[str], env: Mapping[str, str] | None = None, host: str = HOST, timeout: float = START_TIMEOUT
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Start several `(module, *args)` servers at once, so N of them cost about the start-up of one.

    Each server's stderr goes to a temp file (a pipe nobody reads would fill up and stall it) and
    is shown in the error when that server fails to start. All are killed on exit.
    """
    with ExitStack() as stack:
        started: list[tuple[subprocess.Popen[bytes], str, int, list[str], IO[bytes]]] = []
        stack.callback(lambda: stop_all(*(proc for proc, *_ in started)))
        for module, *args in specs:
            port = free_port(host)
            command = [sys.executable, "-m", module, "--http", str(port), "--host", host, *args]
            stderr = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen(
                command,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
            started.append((proc, f"http://{host}:{port}/mcp", port, command, stderr))
        for proc, _, port, command, stderr in started:
            try:
                wait_until_accepting(host, port, proc, timeout)
            except (RuntimeError, TimeoutError) as exc:
                stderr.seek(0)
                raise RuntimeError(f"{' '.join(command)}: {exc}\n{stderr.read().decode(errors='replace')}") from None
        yield [(proc, url) for proc, url, *_ in started]


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
    """Signal one process and wait for it; its exit code (one that hangs past `timeout` is killed)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def stop_all(*procs: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Terminate all at once, then kill any that linger: a test must never leave a server behind."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + grace
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(condition: Callable[[], T], timeout: float = 30, what: str = "condition") -> T:
    """Poll until `condition()` is truthy; a bounded wait, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
