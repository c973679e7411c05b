"""Fail points: armed from the environment, each action really happens in a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from mcp_saga.runtime import failpoints
from mcp_saga.runtime.failpoints import FAILPOINTS_ENV, FailPointError, fail_point


def _run_point(env: dict[str, str], point: str = "worker.after-call") -> subprocess.CompletedProcess[str]:
    script = f"from mcp_saga.runtime.failpoints import fail_point; fail_point({point!r}); print('survived')"
    clean = {k: v for k, v in os.environ.items() if k != FAILPOINTS_ENV and k not in failpoints.LEGACY}
    return subprocess.run(
        [sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True, timeout=30
    )


def test_an_unarmed_point_does_nothing() -> None:
    assert _run_point({}).stdout.strip() == "survived"


@pytest.mark.parametrize(
    ("env", "point", "returncode"),
    [
        ({FAILPOINTS_ENV: "worker.after-call=kill"}, "worker.after-call", -signal.SIGKILL),
        ({FAILPOINTS_ENV: "coordinator.after-commit=exit(70)"}, "coordinator.after-commit", 70),
        ({"SAGA_TEST_CRASH_AFTER_CALL": "1"}, "worker.after-call", -signal.SIGKILL),
        ({"SAGA_TEST_CRASH_AFTER_COMMIT": "1"}, "coordinator.after-commit", 70),
    ],
)
def test_armed_points_kill_or_exit_the_process(env: dict[str, str], point: str, returncode: int) -> None:
    done = _run_point(env, point)
    assert done.returncode == returncode, done.stderr
    assert "survived" not in done.stdout


def test_a_typo_in_the_environment_fails_loudly() -> None:
    done = _run_point({FAILPOINTS_ENV: "worker.after-cal=kill"})
    assert done.returncode != 0
    assert "unknown fail point 'worker.after-cal'" in done.stderr
    with pytest.raises(ValueError, match="cannot read action"):
        failpoints.parse("worker.after-call=explode")


def test_counted_actions_fire_that_many_times() -> None:
    failpoints.arm("worker.after-call=2*raise")
    try:
        for _ in range(2):
            with pytest.raises(FailPointError):
                fail_point("worker.after-call")
        fail_point("worker.after-call")  # the third time it is off again
    finally:
        failpoints.arm("worker.after-call=off")
