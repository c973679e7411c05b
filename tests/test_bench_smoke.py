"""Benches that run in-process code of the product: a smoke run keeps them in step with it.

(A change of the worker's `_Attempt` once broke `bench.observability`, and only a full
`python -m bench` found it.) Tiny sizes: this checks that each part runs and prints its rows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_observability_bench_runs_its_in_process_parts() -> None:
    for parts in ("attempt", "ingest,attempt"):
        done = subprocess.run(
            [sys.executable, "-m", "bench.observability", "--parts", parts, "--workflows", "20", "--steps", "2",
             "--jobs", "8", "--rounds", "2"],
            cwd=ROOT, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        for part in parts.split(","):  # each part printed its first row (the table wraps longer names)
            assert {"attempt": "worker attempt CPU,", "ingest": "ingest,"}[part] in done.stdout, done.stdout[-3000:]
