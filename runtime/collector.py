"""Cyclic garbage collection the way a long-running process on a hot path can afford it.

A coordinator batch or a gateway call allocates some hundred objects (decoded payloads, plans,
messages, futures), nearly all freed by reference counting; with CPython's default thresholds the
cyclic collector still ran every 700 allocations and now and then walked every long-lived object of
the process (modules, redis-py, RQ, the MCP SDK's models), which cost the coordinator more per event
than the decoding itself (issue 15) and the gateway about 5% of its CPU per call (issue 13).
"""

from __future__ import annotations

import gc

# The youngest generation's collection threshold (CPython's default: 700).
GC_YOUNG = 20_000


def tune_gc() -> None:
    """Move what start-up built out of the collector's sight, and collect the young generation less often.

    Call once start-up is done (imports, configuration, long-lived clients)."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 50, 50)
