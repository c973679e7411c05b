"""Starting and stopping real mcp-saga processes in tests (coordinators, workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def saga_process(
    *args: str, redis_url: str, config: Path | None = None, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """`saga ARGS...` as its own process, logging to `log` (for the failure message) or DEVNULL."""
    full_env = {**os.environ, "REDIS_URL": redis_url, "SAGA_LOG": "text", **(env or {})}
    if config is not None:
        full_env["SAGA_CONFIG"] = str(config)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "saga.cli", *args], cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT
    )
    if log:
        out.close()  # type: ignore[union-attr]
    return proc


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> int:
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
