"""Run tests/test_observability.py in an interpreter of its own.

OpenTelemetry's global tracer provider (and the MCP SDK's tracer, which keeps the first provider it
saw) cannot be reset inside one process, so after the rest of the suite those tests would see
spans go elsewhere. A fresh `pytest` process gives them the process they assume.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(600)
def test_observability_in_its_own_interpreter(redis_url: str) -> None:
    env = {**os.environ, "SAGA_OBSERVABILITY_ISOLATED": "1", "SAGA_TEST_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_observability.py")],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=590,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
