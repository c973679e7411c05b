"""Where the reference scenario's time goes, phase by phase, from a Redis MONITOR of its sagas.

    python -m bench.timeline [--redis URL] [--workflows 200] [--capture PATH]

Runs bench/latency.py's reference scenario (refund, then release, as a routing slip) with a MONITOR
client recording every command, then prints per phase the median gap between two commands of one
saga: the failure's XADD, the coordinator's reads and commit, the enqueue, the worker's fetch of
the job, its start MULTI and EXEC, the refund's report XADD (which carries the release's reads), the
release's report. MONITOR costs Redis time and its client a core's share, so every gap reads longer
than in `python -m bench.latency`: the figures say where time goes, not how much a saga takes.
`--capture PATH` keeps the raw MONITOR lines there.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.schemas.keys import Keys

from bench.latency import reference

KEYS = Keys()
# The phases in saga order: each names the first command of one saga that marks it.
PHASES = (
    "failure XADD",
    "coordinator reads the state",
    "coordinator commit",
    "enqueue (RPUSH)",
    "worker fetches the job (HGETALL)",
    "worker start MULTI",
    "worker start EXEC",
    "refund report XADD",
    "release report XADD",
)
_EVENT = r'"XADD" "' + re.escape(KEYS.events) + r'" "\*" "type" "{}" "workflow" "([^"]+)"'
_FAILED = re.compile(_EVENT.format("workflow-failed"))
_REPORT = re.compile(_EVENT.format("compensation-succeeded"))
_READS = re.compile(r'"HGETALL" "[^"]*\{([^}]+)\}:state"')
_COMMIT = re.compile(r'"EVALSHA" "\w+" "\d+" "[^"]*\{([^}]+)\}:state"')
# RQ's own key of the saga queue (RQ prefixes the queue's name itself).
_ENQUEUE = re.compile(r'"RPUSH" "rq:queue:' + re.escape(KEYS.queue) + r'" "([^"]+)"')
_FETCH = re.compile(r'^\S+ \[\d+ ([^\]]+)\] "HGETALL" "rq:job:([^"]+)"')
_TRANSACTION = re.compile(r'^\S+ \[\d+ ([^\]]+)\] "(MULTI|EXEC)"$')


def saga_marks(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    """Workflow -> phase -> time (s) of the phase's first command for that saga."""
    marks: dict[str, dict[str, float]] = defaultdict(dict)
    job_workflow: dict[str, str] = {}
    client_workflow: dict[str, str] = {}
    committed: list[str] = []  # workflows committed and not yet enqueued, oldest first
    for line in lines:
        at = float(line.split(" ", 1)[0])
        if m := _FAILED.search(line):
            marks[m[1]].setdefault(PHASES[0], at)
        elif (m := _READS.search(line)) and PHASES[0] in marks.get(m[1], {}):
            marks[m[1]].setdefault(PHASES[1], at)
        elif (m := _COMMIT.search(line)) and PHASES[1] in marks.get(m[1], {}) and PHASES[2] not in marks[m[1]]:
            marks[m[1]][PHASES[2]] = at
            committed.append(m[1])
        elif (m := _ENQUEUE.search(line)) and committed:
            workflow = committed.pop(0)
            marks[workflow][PHASES[3]] = at
            job_workflow[m[1]] = workflow
        elif (m := _FETCH.search(line)) and m[2] in job_workflow:
            workflow = job_workflow.pop(m[2])
            marks[workflow].setdefault(PHASES[4], at)
            client_workflow[m[1]] = workflow
        elif (m := _TRANSACTION.search(line)) and m[1] in client_workflow:
            phase = PHASES[5] if m[2] == "MULTI" else PHASES[6]
            marks[client_workflow[m[1]]].setdefault(phase, at)
            if m[2] == "EXEC":
                del client_workflow[m[1]]
        elif m := _REPORT.search(line):
            phase = PHASES[7] if PHASES[7] not in marks[m[1]] else PHASES[8]
            marks[m[1]].setdefault(phase, at)
    return marks


def gaps(marks: dict[str, dict[str, float]]) -> list[tuple[str, float, int]]:
    """(phase pair, median gap in ms, sagas) over the sagas that passed every phase in order."""
    complete = [m for m in marks.values() if len(m) == len(PHASES)]
    complete = [m for m in complete if all(m[a] <= m[b] for a, b in itertools.pairwise(PHASES))]
    if not complete:
        return []
    pairs = [*itertools.pairwise(PHASES), (PHASES[0], PHASES[-1])]
    return [(f"{a} -> {b}", statistics.median((m[b] - m[a]) * 1000 for m in complete), len(complete)) for a, b in pairs]


def monitored(redis_url: str, workflows: int, capture: Path) -> list[str]:
    """The reference scenario's MONITOR lines, as `redis-cli MONITOR` prints them (time [db client] "CMD" ...)."""
    with capture.open("w") as out:
        recorder = subprocess.Popen(["redis-cli", "-u", redis_url, "MONITOR"], stdout=out, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)  # connected before the first saga
            reference(redis_url, workflows)
        finally:
            recorder.terminate()
            recorder.wait(10)
    return capture.read_text().splitlines()[1:]  # the first line is redis-cli's OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="Redis URL (default: a private redis-server)")
    parser.add_argument("--workflows", type=int, default=200)
    parser.add_argument("--capture", type=Path, help="also write the MONITOR lines here")
    args = parser.parse_args(argv)
    with resolve_redis(args.redis) as url, tempfile.TemporaryDirectory(prefix="saga-bench-timeline-") as tmp:
        lines = monitored(url, args.workflows, args.capture or Path(tmp) / "monitor")
    for phase, median, sagas in gaps(saga_marks(lines)):
        print(f"{phase:70} {median:7.3f} ms  ({sagas} sagas)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
