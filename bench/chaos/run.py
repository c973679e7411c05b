"""The run itself: start the cluster and the publishers, strike the faults on schedule, wait, verify, watch expiry."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
from mcp_saga.cli.procs import REPO
from mcp_saga.examples.ledger import read_state
from mcp_saga.schemas.keys import STATUSES, Keys

from bench.chaos.cluster import Cluster, _terminate
from bench.chaos.model import SERVERS, TERMINAL, Out, Report, Settings
from bench.chaos.verify import (
    Tracker,
    dead_letters,
    events_outstanding,
    footprint,
    memory_of,
    memory_overrun,
    verify,
    worker_log_events,
)

# The run ----------------------------------------------------------------------------------------


def schedule(settings: Settings, rng: random.Random) -> list[tuple[float, str]]:
    """When (in share of finished workflows) each fault strikes: kills spread out, Redis mid-run."""
    kills = [kind for _ in range(settings.kills) for kind in ("coordinator", "worker")]
    plan = [(0.05 + 0.85 * (i + 0.5) / len(kills), kind) for i, kind in enumerate(kills)]
    for i in range(settings.server_restarts):
        plan.append((0.3 + 0.4 * i / max(1, settings.server_restarts), f"server:{SERVERS[(i + 1) % 3]}"))
    for i in range(settings.redis_restarts):
        plan.append((0.5 + 0.3 * i / max(1, settings.redis_restarts), "redis"))
    for i in range(settings.crashes_after_call):
        plan.append((0.2 + 0.5 * i / max(1, settings.crashes_after_call), "crash-after-call"))
    for i in range(settings.blackholes):
        plan.append((0.25 + 0.5 * i / max(1, settings.blackholes), f"blackhole:{SERVERS[i % 3]}"))
    for i in range(settings.fills):
        plan.append((0.35 + 0.4 * i / max(1, settings.fills), "fill"))
    for i in range(settings.wipes):
        plan.append((0.1 + 0.1 * i / max(1, settings.wipes), "wipe"))  # early: most workflows run after it
    for i in range(settings.stalls):
        for kind in ("coordinator", "worker"):
            plan.append((0.15 + 0.6 * i / max(1, settings.stalls), f"stall:{kind}"))
    for i in range(settings.primary_kills):  # mid-run, while unwinds are in flight
        plan.append((0.4 + 0.3 * i / max(1, settings.primary_kills), "primary"))
    return sorted(plan)


def run_chaos(settings: Settings, out: Out = print) -> Report:
    """Run the whole thing and return what it found; never raises for a broken guarantee, reports it."""
    started = time.monotonic()
    seed = settings.seed if settings.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    workdir = Path(settings.workdir or tempfile.mkdtemp(prefix="saga-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(seed=seed, workdir=str(workdir))
    cluster = Cluster(settings, workdir, rng, out)
    keys = cluster.keys
    publishers: list[subprocess.Popen[bytes]] = []
    tracker: Tracker | None = None
    out(f"chaos run: {settings.workflows} workflows, {settings.publishers} publishers, seed {seed}, in {workdir}")
    try:
        cluster.start()
        r = cluster.client()
        q = cluster.queue_client()
        _wait(lambda: all(_group_exists(r, k) for k in keys.every()), 30, "the coordinators' consumer groups")
        _wait(lambda: q.scard(f"rq:workers:{keys.queue}") >= settings.workers, 30, "the workers to register")
        before = footprint(r, keys, queue=q)
        report.memory_before = before["used_memory"]
        publishing_since = time.monotonic()

        paths = [workdir / f"publisher-{i}.jsonl" for i in range(settings.publishers)]
        ids = [f"chaos-{i % settings.publishers}-{i:05d}" for i in range(settings.workflows)]
        urls = {name: server.url for name, server in cluster.servers.items()}
        for i, path in enumerate(paths):
            spec = {"settings": asdict(settings), "redis": cluster.url, "urls": urls, "records": str(path),
                    "seed": seed, "workflows": ids[i :: settings.publishers],
                    "redis_settings": cluster.redis_settings().model_dump()}  # fmt: skip
            spec_path = workdir / f"publisher-{i}.json"
            spec_path.write_text(json.dumps(spec))
            with open(workdir / f"publisher-{i}.log", "ab") as log:
                publishers.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.chaos", "--publish", str(spec_path)],
                    cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                ))  # fmt: skip

        tracker = Tracker(r, keys, paths)
        tracker.start()  # its own thread: a fault that blocks this loop for seconds must not blind it
        faults = schedule(settings, rng)
        publish_deadline = time.monotonic() + settings.publish_timeout
        while any(p.poll() is None for p in publishers) or faults:
            if time.monotonic() > publish_deadline:
                report.violations.append(f"publishers still running after {settings.publish_timeout:g} s; stopped")
                for p in publishers:
                    _terminate(p)
                break
            tracker.poll()
            done = len(tracker.records) / settings.workflows
            publishing = any(p.poll() is None for p in publishers)
            if faults and (faults[0][0] <= done or not publishing):
                _, fault = faults.pop(0)
                if fault == "redis":
                    cluster.restart_redis()
                elif fault == "wipe":
                    with tracker.lock:  # nothing snapshotted from the empty Redis counts as settled before
                        tracker.poll()
                        tracker.wiped(*cluster.wipe_redis())
                elif fault == "fill":
                    cluster.fill_redis()
                elif fault.startswith("blackhole:"):
                    cluster.blackhole_server(fault.removeprefix("blackhole:"))
                elif fault.startswith("server:"):
                    cluster.restart_server(fault.removeprefix("server:"))
                elif fault == "crash-after-call":
                    cluster.spawn_doomed()
                elif fault.startswith("stall:"):
                    cluster.stall(fault.removeprefix("stall:"))
                elif fault == "primary":
                    cluster.kill_primary()
                    tracker.failed_over(*cluster.failovers[-1])
                else:
                    cluster.kill(fault)
                if not publishing:
                    time.sleep(0.5)  # the publishers were quicker: keep the faults apart while the unwind runs
            cluster.check()
            time.sleep(0.1)
        for i, p in enumerate(publishers):
            if p.returncode != 0:
                report.violations.append(f"publisher {i} exited with {p.returncode}; see {workdir}/publisher-{i}.log")
        published_at = time.monotonic()
        report.publish_seconds = published_at - publishing_since
        out(f"  publishers done ({len(tracker.records)} workflows recorded); waiting for quiescence")

        deadline = published_at + settings.settle_timeout
        tracker.poll()
        # Settled statuses are not enough: a step held by a killed coordinator is claimed later and
        # may still change a completed workflow's history. Quiet means nothing pending or unread too.
        while (tracker.waiting() or events_outstanding(r, keys)) and time.monotonic() < deadline:
            time.sleep(0.3)
            cluster.check()
            tracker.poll()
        tracker.stop()
        tracker.refresh()
        report.settle_seconds = time.monotonic() - published_at
        for workflow in tracker.waiting():
            status = r.hget(keys.state(workflow), "status")
            out(f"  ! {workflow} did not settle: {status.decode() if status else 'no state'}")

        ledgers = {name: read_state(server.db) for name, server in cluster.servers.items()}
        dead = [entry for k in keys.every() for entry in dead_letters(r, k)]
        for entry in dead:
            report.dead_letters[entry["reason"][:120]] = report.dead_letters.get(entry["reason"][:120], 0) + 1
        crashed = cluster.crashed_jobs()
        worker_log = worker_log_events(workdir)
        verify(tracker.records, tracker.snapshots, ledgers, worker_log, dead, report, crashed, tracker.lost(),
               tracker.failover_losses(), tracker.later)  # fmt: skip
        report.workflows = len(tracker.records)
        if report.workflows != settings.workflows:
            report.violations.append(f"{settings.workflows - report.workflows} workflows have no publisher record")

        # Events published: each recorded step and terminal event, and each attempt report of a worker.
        report.events_added = sum(len(rec["steps"]) + rec["terminalPublished"] for rec in tracker.records.values())
        reports = ("compensation succeeded", "compensation failed")
        report.events_added += sum(e.get("msg") in reports for e in worker_log)
        with contextlib.suppress(redis.RedisError):
            report.memory_peak = memory_of(r, "used_memory_peak")
        out(f"  verified; waiting up to {settings.expiry_timeout:.0f} s for retention expiry")
        deadline = time.monotonic() + settings.expiry_timeout
        # Never settled, as documented: no terminal event was published, or Redis lost it with its data
        # (a step write retried across the wipe may re-create a `running` workflow whose end is gone).
        # Their keys stay until `idle_ttl`.
        lost = tracker.lost()
        unfinished = frozenset(w for w, rec in tracker.records.items() if not rec["terminalPublished"] or w in lost)
        # A later incarnation that a step alone started stays `running` until `idle_ttl` (README, "Not promised").
        unfinished |= {w for w, again in tracker.later.items() if any(s.state.get("status") not in TERMINAL
                                                                      for s in again.values())}  # fmt: skip
        after = footprint(r, keys, unfinished, queue=q)
        while (after["workflow_keys"] or after["indexed"]) and time.monotonic() < deadline:
            time.sleep(1)
            cluster.check()
            after = footprint(r, keys, unfinished, queue=q)
        report.memory_detail = {"before": before, "after": after}
        report.workflow_keys_after = after["workflow_keys"]
        report.memory_after, report.rq_bytes_after = after["used_memory"], after["rq_bytes"]
        if after["workflow_keys"]:
            report.violations.append(f"{after['workflow_keys']} per-workflow keys left after retention expiry")
        if after["indexed"]:
            left = ", ".join(index_entries(r, keys, unfinished)[:10])
            report.violations.append(f"{after['indexed']} index/deadline entries left after retention expiry: {left}")
        # On a cluster the nodes' own overhead moves with a failover (the promoted replica's
        # replication backlog, the killed primary's memory gone from the sum): keys and index
        # entries are checked there, memory only reported.
        overrun = memory_overrun(before, after, settings.memory_slack)
        if overrun and not settings.redis_cluster:
            report.violations.append(overrun)
        r.close()
        q.close()
    finally:
        if tracker is not None:
            tracker.stop()
        for p in publishers:
            _terminate(p)
        cluster.stop()
        report.coordinator_kills = cluster.kills["coordinator"]
        report.worker_kills = cluster.kills["worker"]
        report.worker_kills_mid_job = cluster.busy_kills
        report.crashes_after_call = cluster.crashes
        report.server_restarts = cluster.restarts["server"]
        report.redis_restarts = cluster.restarts["redis"]
        report.redis_wipes = cluster.restarts["wipe"]
        report.primary_kills = cluster.restarts["primary"]
        report.failover_seconds = max((healthy - killed for killed, healthy, _ in cluster.failovers), default=0.0)
        report.redis_fills = cluster.fills
        report.redis_full_seconds = max(cluster.full_windows, default=0.0)
        report.stall_seconds = max(cluster.stall_windows, default=0.0)
        report.violations += window_overruns(settings, cluster.full_windows, cluster.stall_windows)
        report.oom_refusals = cluster.oom_refusals
        report.server_blackholes = cluster.blackholes
        report.coordinator_stalls = cluster.stalls["coordinator"]
        report.worker_stalls = cluster.stalls["worker"]
        report.unexpected_exits = len(cluster.unexpected)
        report.violations += [f"unexpected exit: {u}" for u in cluster.unexpected]
        report.wall_seconds = time.monotonic() - started
        if not settings.keep and report.ok and settings.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


# How much longer than its window a fill or a stall may last before the run says its figures mislead.
WINDOW_SLACK = 2.0


def window_overruns(settings: Settings, fills: list[float], stalls: list[float]) -> list[str]:
    """The harness's own failures: a fill or a stall that outlasted its window.

    A full Redis fails every workflow that runs meanwhile and a stall past the retention makes
    what it held start new workflows, so a window that overran changes what the run measures.
    """
    found = [f"harness: Redis was held full for {s:.1f} s (its window is {settings.full_seconds:g} s)"
             for s in fills if s > settings.full_seconds + WINDOW_SLACK]  # fmt: skip
    found += [f"harness: a SIGSTOP lasted {s:.1f} s (its window is {settings.stall_seconds:g} s)"
              for s in stalls if s > settings.stall_seconds + WINDOW_SLACK]  # fmt: skip
    return found


def index_entries(r: Any, keys: Keys, unfinished: frozenset[str]) -> list[str]:
    """The index and deadline entries of workflows expected gone: `key member (state: status or gone)`."""
    found = []
    for part in keys.every():
        for key in [part.index(s) for s in STATUSES] + [part.deadlines]:
            for member in r.zrange(key, 0, -1):
                workflow = member.decode()
                if workflow not in unfinished:
                    status = r.hget(keys.state(workflow), "status")
                    found.append(f"{key} {workflow} ({status.decode() if status else 'gone'})")
    return found


def _group_exists(r: Any, keys: Keys) -> bool:
    with contextlib.suppress(redis.ResponseError):
        return bool(r.xinfo_groups(keys.events))
    return False


def _wait(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def print_report(report: Report, out: Out = print) -> None:
    out("")
    out(report.table())
    if report.attention:
        out("\nneeds-attention reasons:")
        for reason, n in Counter(report.attention.values()).most_common(10):
            out(f"  {n} x {reason[:300]}")
    if report.dead_letters:
        out("\ndead letters:")
        for reason, n in report.dead_letters.items():
            out(f"  {n} x {reason}")
    if report.failover_notes:
        out(f"\nlost with a cluster primary's SIGKILL ({report.failover_lost} events):")
        for note in report.failover_notes[:50]:
            out(f"  {note}")
    if report.violations:
        out(f"\n{len(report.violations)} GUARANTEE VIOLATION(S) (logs and ledgers kept in {report.workdir}):")
        for violation in report.violations[:50]:
            out(f"  - {violation}")
    else:
        out("\nevery guarantee held")
