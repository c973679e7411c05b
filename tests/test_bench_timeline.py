"""The timeline bench's reading of a MONITOR capture: each command lands in its own saga's phase."""

from __future__ import annotations

import sys

import pytest
from processes import REPO

sys.path.insert(0, str(REPO))  # `bench` is not an installed package
from bench.timeline import PHASES, gaps, saga_marks


def _saga(workflow: str, job: str, worker: str, start: float) -> list[tuple[float, str]]:
    """One saga's marking commands, `start` seconds in, a millisecond apart."""
    commands = [
        f'[0 127.0.0.1:1] "XADD" "saga:events" "*" "type" "workflow-failed" "workflow" "{workflow}" "data" "{{}}"',
        f'[0 127.0.0.1:2] "HGETALL" "saga:{{{workflow}}}:state"',
        f'[0 127.0.0.1:2] "EVALSHA" "ed007f" "5" "saga:{{{workflow}}}:state" "saga:{{{workflow}}}:steps"',
        f'[0 127.0.0.1:2] "RPUSH" "rq:queue:saga" "{job}"',
        f'[0 {worker}] "HGETALL" "rq:job:{job}"',
        f'[0 {worker}] "MULTI"',
        f'[0 {worker}] "EXEC"',
        f'[0 {worker}] "XADD" "saga:events" "*" "type" "compensation-succeeded" "workflow" "{workflow}" "data" "{{}}"',
        f'[0 {worker}] "XADD" "saga:events" "*" "type" "compensation-succeeded" "workflow" "{workflow}" "data" "{{}}"',
    ]
    return [(start + i / 1000, command) for i, command in enumerate(commands)]


def test_two_interleaved_sagas_each_get_their_own_phases() -> None:
    first = _saga("ref-1", "saga-a-1", "127.0.0.1:3", 100.0)
    second = _saga("ref-2", "saga-b-1", "127.0.0.1:4", 100.0045)  # its failure lands mid-way through the first
    noise = [(100.0021, '[0 lua] "HGET" "saga:{ref-1}:state" "version"'), (100.003, '[0 127.0.0.1:9] "PING"')]
    lines = [f"{at:.6f} {command}" for at, command in sorted(first + second + noise)]

    marks = saga_marks(lines)

    assert set(marks) == {"ref-1", "ref-2"}
    for workflow, start in (("ref-1", 100.0), ("ref-2", 100.0045)):
        assert [marks[workflow][phase] for phase in PHASES] == pytest.approx([start + i / 1000 for i in range(9)])
    rows = gaps(marks)
    assert [sagas for _, _, sagas in rows] == [2] * len(PHASES)
    assert [median for _, median, _ in rows] == pytest.approx([1.0] * (len(PHASES) - 1) + [8.0])


def test_a_saga_missing_a_phase_is_left_out() -> None:
    lines = [f"{at:.6f} {command}" for at, command in _saga("ref-1", "saga-a-1", "127.0.0.1:3", 100.0)[:-1]]
    assert gaps(saga_marks(lines)) == []
