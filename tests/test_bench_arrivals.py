"""The latency bench's reader of the server's arrivals file (its order check rests on it)."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest
from processes import REPO

sys.path.insert(0, str(REPO))  # `bench` is not an installed package
from bench.latency import Arrivals


@pytest.mark.parametrize("woken", [True, False], ids=["inotify", "polled"])
def test_a_line_read_half_written_keeps_its_time_and_number(tmp_path: Path, woken: bool) -> None:
    path = tmp_path / "arrivals"
    arrivals = Arrivals(path)
    assert arrivals.watch is not None, "Linux has inotify: the bench must not poll there"
    if not woken:
        os.close(arrivals.watch)
        arrivals.watch = None
    with closing(arrivals), path.open("a", buffering=1) as out:
        out.write("1764619000.123456 7\n1764619000.2")  # the second line's first page, as a reader may see it
        out.flush()
        assert arrivals.wait(7, timeout=1) == 1764619000.123456
        timer = threading.Timer(0.05, lambda: (out.write("50000 8\n"), out.flush()))
        timer.start()
        try:
            assert arrivals.wait(8, timeout=5) == 1764619000.250000
        finally:
            timer.join()
