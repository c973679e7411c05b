"""Chaos run: many concurrent workflows while coordinators, workers, an MCP server and Redis die under them.

    python -m bench.chaos [--workflows 500] [--publishers 4] [--kills 5] [--json PATH] [--seed N] [--keep] [--cluster]

mcp-saga promises that every committed step of a failed workflow is undone exactly once and that
nothing is lost or doubled when its own processes die. This run tries to break that with real
processes: publisher processes run workflows over the example servers while coordinators and
workers are SIGKILLed and restarted or SIGSTOPped and resumed (a worker mid-call), one example
server is stopped and restarted on the same port and database and another black-holed (SIGSTOP:
its calls hang), Redis is held at `maxmemory` for a while (writes refused with OOM),
`redis-server` is restarted with its append-only file and once without its data, and the servers
inject transient errors into compensation calls. The workflows in flight when Redis lost its data
are expected lost: they are counted, with their effects left in place, not flagged. After
quiescence the promise is checked against the example servers' own SQLite ledgers (what really
happened), the publishers' records (what the orchestrators committed) and Redis (what mcp-saga
recorded), never against mcp-saga's view alone.
Then it waits for retention to expire and checks that Redis is back to its baseline.

With `--cluster` (`Settings.reduced_cluster()` in the tests) the same run goes to a local Redis
Cluster (three primaries with a replica each, three partitions, RQ's queue on a standalone
redis-server), and instead of the one Redis's restarts, fill and wipe, the primary that holds a
partition's events stream is SIGKILLed mid-run; its replica takes over. What that primary had
acknowledged and not yet replicated is lost with it: the verifier counts what the workflows in
flight on it miss, each with a note, and flags every other loss.

`run_chaos(Settings(...))` is what this command, `bench/soak.py` and `tests/test_chaos.py` call.
Modules: `model` (Settings, Report), `agents` (publisher processes), `cluster` (processes and
faults), `verify` (watching Redis, checking against the ledgers), `run` (the schedule and the run).
"""

from bench.chaos.model import Report, Settings
from bench.chaos.run import print_report, run_chaos

__all__ = ["Report", "Settings", "print_report", "run_chaos"]
