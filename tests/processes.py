"""Starting and stopping real mcp-saga processes in tests (coordinators, workers, MCP servers)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

from mcp_saga.cli.procs import (  # noqa: F401 - re-exported for the tests
    REPO,
    free_port,
    saga_process,
    start_http_server,
    start_http_servers,
    stdio_params,
    wait_until_accepting,
)

T = TypeVar("T")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    """Signal one process and wait for it; its exit code (a hang past `timeout` is killed)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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
