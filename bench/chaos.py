"""Chaos run: many concurrent workflows while coordinators, workers, an MCP server and Redis die under them.

    python -m bench.chaos [--workflows 500] [--publishers 4] [--kills 5] [--json PATH] [--seed N] [--keep]

mcp-saga promises that every committed step of a failed workflow is undone exactly once and that
nothing is lost or doubled when its own processes die. This run tries to break that with real
processes: publisher processes run workflows over the example servers while coordinators and
workers are SIGKILLed and restarted, one example server is stopped and restarted on the same port
and database, `redis-server` is restarted with its append-only file, and the servers inject
transient errors into compensation calls. After quiescence the promise is checked against the
example servers' own SQLite ledgers (what really happened), the publishers' records (what the
orchestrators committed) and Redis (what mcp-saga recorded), never against mcp-saga's view alone.
Then it waits for retention to expire and checks that Redis is back to its baseline.

`run_chaos(Settings(...))` is what both this command and `tests/test_chaos.py` call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from mcp_saga.cli.procs import REPO, free_port, saga_process, wait_until_accepting
from mcp_saga.cli.redis_server import NoRedisError, RedisServer, find_redis_server
from mcp_saga.examples.ledger import TRANSIENT_PREFIX, read_state
from mcp_saga.runtime.failpoints import FAILPOINTS_ENV
from mcp_saga.schemas.keys import DEAD_REASON, STATUSES, Keys

import mcp_saga

SERVERS = ("inventory", "payments", "shipping")
# tool -> (server, field of the result naming the holding it created, status it creates)
FORWARD = {
    "reserve_inventory": ("inventory", "reservationId", "active"),
    "charge_payment": ("payments", "transactionId", "charged"),
    "create_shipment": ("shipping", "shipmentId", "created"),
}
# server -> (compensating tool, the status a holding has once undone)
UNDO = {"inventory": ("release_inventory", "released"), "payments": ("refund_payment", "refunded"),
        "shipping": ("cancel_shipment", "cancelled")}  # fmt: skip
UNDO_TOOLS = {tool for tool, _ in UNDO.values()}
TERMINAL = ("completed", "compensated", "needs-attention")
Out = Callable[[str], None]


@dataclass
class Settings:
    """One chaos run. The defaults are the full run; `Settings.reduced()` is the test suite's."""

    workflows: int = 500
    publishers: int = 4
    concurrency: int = 5  # workflows in flight per publisher
    coordinators: int = 2
    workers: int = 3
    kills: int = 5  # SIGKILLs of coordinators, and as many of workers
    server_restarts: int = 1
    redis_restarts: int = 1
    crashes_after_call: int = 2  # extra workers that die between a compensation call and its report
    min_steps: int = 3
    max_steps: int = 5
    fail_share: float = 0.4  # share of workflows that fail, at a random step
    fail_rate: float = 0.2  # share of compensation calls the servers fail transiently
    # mcp-saga's own timeouts, short so that the watchdog, claims and leases all get exercised.
    watchdog_after: float = 4.0
    claim_idle_ms: int = 1000
    barrier_grace: float = 5.0
    lease: float = 4.0
    call_timeout: float = 3.0  # a worker's timeout per compensation call (below the lease)
    attempts: int = 6
    backoff_base: float = 0.5
    backoff_max: float = 2.0
    job_timeout: int = 15
    retention: int = 15  # seconds a settled workflow stays in Redis (short, so expiry can be watched)
    idle_ttl: int = 300
    publisher_call_timeout: float = 15.0
    publish_timeout: float = 600.0  # bounded wait for the publishers
    settle_timeout: float = 180.0  # bounded wait for quiescence after the publishers finished
    expiry_timeout: float = 90.0  # bounded wait for keys to expire after quiescence
    memory_slack: int = 1024 * 1024  # bytes above the baseline still called "back to baseline"
    seed: int | None = None
    workdir: str | None = None
    keep: bool = False

    @classmethod
    def reduced(cls, **overrides: Any) -> Settings:
        """The test suite's run: every kind of fault at least twice, well under a minute and a half."""
        base = dict(workflows=48, publishers=2, concurrency=4, workers=2, kills=2, retention=6, expiry_timeout=60)
        return cls(**{**base, **overrides})


@dataclass
class Report:
    """What the run did and found; `violations` is empty when every guarantee held."""

    workflows: int = 0
    completed: int = 0
    failed: int = 0
    steps: int = 0
    compensations: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    coordinator_kills: int = 0
    worker_kills: int = 0
    worker_kills_mid_job: int = 0
    server_restarts: int = 0
    redis_restarts: int = 0
    unexpected_exits: int = 0
    injected_errors: int = 0
    transport_errors: int = 0  # compensation calls that got no answer (the server restart)
    dispatches: int = 0
    redispatches: int = 0
    crashes_after_call: int = 0
    crash_repeats: int = 0  # of those, compensations whose call had taken effect and was made again
    repeat_calls: int = 0  # compensation calls that reached a server again for an already-applied key
    duplicate_jobs_stopped: int = 0  # job runs that a worker skipped (already settled, stale, leased)
    double_effects: int = 0
    lost_events: int = 0
    out_of_order: int = 0  # failed workflows whose undos were not applied last-first
    late_steps: int = 0  # steps of completed workflows handled after their completion (a kill reordered them)
    left_for_human: int = 0  # committed effects of needs-attention workflows, not undone, with a reason
    unseen_effects: int = 0  # effects a server applied but no orchestrator learned of (not mcp-saga's to undo)
    attention: dict[str, str] = field(default_factory=dict)
    dead_letters: dict[str, int] = field(default_factory=dict)
    workflow_keys_after: int = -1
    memory_detail: dict[str, dict[str, int]] = field(default_factory=dict)
    memory_before: int = 0
    memory_after: int = 0
    rq_bytes_after: int = 0
    settle_seconds: float = 0.0
    wall_seconds: float = 0.0
    seed: int = 0
    workdir: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def rows(self) -> list[tuple[str, str]]:
        statuses = ", ".join(f"{n} {s}" for s, n in sorted(self.statuses.items()))
        return [
            ("workflows", f"{self.workflows} ({self.completed} completed, {self.failed} failed: {statuses})"),
            ("steps", str(self.steps)),
            ("compensations", f"{self.compensations} ({self.dispatches} dispatched, {self.redispatches} again)"),
            (
                "kills survived",
                f"{self.coordinator_kills} coordinator, {self.worker_kills} worker "
                f"({self.worker_kills_mid_job} mid-job), SIGKILL; {self.crashes_after_call} workers died "
                "between a call and its report",
            ),
            ("server restarts", str(self.server_restarts)),
            ("redis restarts", f"{self.redis_restarts} (append-only file on)"),
            (
                "injected errors",
                f"{self.injected_errors} (+ {self.transport_errors} calls with no answer while a server restarted)",
            ),
            (
                "repeats absorbed",
                f"{self.repeat_calls} calls by the idempotency key ({self.crash_repeats} after a worker died between "
                f"call and report), {self.duplicate_jobs_stopped} job runs by the record or lease",
            ),
            ("double effects", str(self.double_effects)),
            ("out of LIFO order", str(self.out_of_order)),
            (
                "lost events",
                f"{self.lost_events}"
                + (
                    f" ({self.late_steps} steps of completed workflows were reordered by a kill "
                    "and recorded after the completion)"
                    if self.late_steps
                    else ""
                ),
            ),
            ("needs-attention", f"{len(self.attention)} workflows, {self.left_for_human} effects left with a reason"),
            (
                "effects no one published",
                f"{self.unseen_effects} (a call the orchestrator saw fail but the server ran)",
            ),
            ("keys after expiry", f"{self.workflow_keys_after} per-workflow keys"),
            (
                "redis memory",
                f"{self.memory_before / 1e6:.2f} MB before, {self.memory_after / 1e6:.2f} MB after "
                f"({self.rq_bytes_after / 1e6:.2f} MB of it RQ job records)",
            ),
            ("wall time", f"{self.wall_seconds:.0f} s (quiescent {self.settle_seconds:.0f} s after the last workflow)"),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"| {'':{width}} | chaos run |", f"| {'-' * width} | --- |"]
        lines += [f"| {k:{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)


# The orchestrators ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One workflow's script: the calls in order, and where (and how) it fails, if it does."""

    steps: list[tuple[str, str, dict[str, Any]]]
    fail_at: int | None = None  # index of the step that fails (or before which the agent gives up)
    mode: str | None = None  # "tool": the call fails (isError); "raise": the agent's own code raises


def plan_workflow(rng: random.Random, workflow: str, settings: Settings) -> Plan:
    """Every holding's data names its workflow and step, so even an effect nobody reported is traceable."""
    steps = []
    for i in range(rng.randint(settings.min_steps, settings.max_steps)):
        ref = f"{workflow}/{i}"
        match rng.choice(tuple(FORWARD)):
            case "reserve_inventory":
                steps.append(("inventory", "reserve_inventory", {"sku": ref, "quantity": rng.randint(1, 5)}))
            case "charge_payment":
                steps.append(("payments", "charge_payment", {"orderId": ref, "amount": rng.randint(100, 99_999) / 100}))
            case _:
                steps.append(("shipping", "create_shipment", {"orderId": ref, "address": f"{i} Chaos Street"}))
    if rng.random() >= settings.fail_share:
        return Plan(steps)
    if rng.random() < 0.5:
        at = rng.randrange(len(steps))
        failing = {"orderId": f"{workflow}/{at}", "address": "nowhere", "simulateFailure": True}
        return Plan([*steps[:at], ("shipping", "create_shipment", failing)], at, "tool")
    return Plan(steps, rng.randint(0, len(steps)), "raise")


class AgentGaveUp(RuntimeError):
    """The orchestrator's own code failing between calls, as agents do."""


class Link:
    """One publisher's client for one server, reopened by its own task when a call finds it broken.

    An MCP client must be closed by the task that opened it, and one whose server went away stays
    broken, so workflows borrow the current client and report a broken one here.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None
        self.ready = asyncio.Event()
        self.broken = asyncio.Event()
        self.closing = False

    async def own(self) -> None:
        from mcp import Client

        while not self.closing:
            with contextlib.suppress(Exception):
                async with Client(self.url) as client:
                    self.client = client
                    self.ready.set()
                    await self.broken.wait()
            self.ready.clear()
            self.client = None
            self.broken.clear()
            if not self.closing:
                await asyncio.sleep(0.2)

    async def get(self, timeout: float) -> Any:
        async with asyncio.timeout(timeout):
            while True:
                await self.ready.wait()
                if self.client is not None:
                    return self.client

    def failed(self, client: Any) -> None:
        if client is self.client:
            self.broken.set()

    def close(self) -> None:
        self.closing = True
        self.broken.set()


async def run_workflow(workflow: str, plan: Plan, links: dict[str, Link], r: Any, settings: Settings) -> dict[str, Any]:
    """Run one workflow through the SDK; the record says what was committed and what was published.

    `wf.flush()` after each call makes the record exact: the SDK writes a step's event in the
    background, and only a confirmed write counts as published here.
    """
    from mcp_saga.orchestrator.wrapper import StepNotRecorded, ToolCallFailed

    record: dict[str, Any] = {
        "workflow": workflow, "planned": len(plan.steps), "mode": plan.mode, "steps": [], "unpublished": [],
        "outcome": None, "error": None, "terminalPublished": True,
    }  # fmt: skip
    try:
        clients = {name: await link.get(settings.publisher_call_timeout) for name, link in links.items()}
    except TimeoutError:
        record.update(outcome="not-started", terminalPublished=False, error="no MCP connection")
        return record
    body_done = False
    try:
        async with mcp_saga.workflow(workflow, redis=r, servers=clients, settle_timeout=10) as wf:
            for i, (server, tool, arguments) in enumerate(plan.steps):
                if plan.mode == "raise" and plan.fail_at == i:
                    raise AgentGaveUp(f"agent gave up before step {i}")
                try:
                    async with asyncio.timeout(settings.publisher_call_timeout):
                        result = await wf.call(server, tool, arguments, step=f"s{i}")
                except (ToolCallFailed, StepNotRecorded):
                    raise
                except Exception as exc:  # the transport: this client is done for
                    if not isinstance(exc, redis.RedisError):
                        links[server].failed(clients[server])
                    raise
                holding = (result.structured_content or {})[FORWARD[tool][1]]
                step = {"step": f"s{i}", "server": server, "tool": tool, "holding": holding}
                try:
                    await wf.flush()
                except StepNotRecorded:  # committed on the server, its event not confirmed in Redis
                    record["unpublished"].append(step)
                    raise
                record["steps"].append(step)
            if plan.mode == "raise" and plan.fail_at == len(plan.steps):
                raise AgentGaveUp("agent gave up after the last step")
            body_done = True
    except Exception as exc:
        record["outcome"] = "completed" if body_done else "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        notes = getattr(exc, "__notes__", [])
        record["terminalPublished"] = not body_done and not any("NOT published" in n for n in notes)
    else:
        record["outcome"] = "completed"
    return record


async def publish(spec: dict[str, Any]) -> None:
    """One publisher process: `concurrency` workflows at a time, one JSON line per finished workflow."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    settings = Settings(**spec["settings"])
    # One client for all workflows, as an agent would have, retrying through a Redis restart.
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), 10)
    r = aioredis.Redis.from_url(spec["redis"], retry=retry)
    links = {name: Link(url) for name, url in spec["urls"].items()}
    owners = [asyncio.create_task(link.own()) for link in links.values()]
    pending = list(reversed(spec["workflows"]))
    out = open(spec["records"], "a", buffering=1)  # noqa: SIM115 - closed below; a line per workflow

    async def loop() -> None:
        while pending:
            workflow = pending.pop()
            plan = plan_workflow(random.Random(f"{spec['seed']}:{workflow}"), workflow, settings)
            started = time.time()
            record = await run_workflow(workflow, plan, links, r, settings)
            record.update(started=started, ended=time.time())
            out.write(json.dumps(record) + "\n")

    try:
        await asyncio.gather(*(loop() for _ in range(settings.concurrency)))
    finally:
        out.close()
        for link in links.values():
            link.close()
        await asyncio.wait(owners, timeout=10)
        await r.aclose()


# The processes ----------------------------------------------------------------------------------


@dataclass
class ExampleServer:
    """An example MCP server that can be stopped and started again on the same port and database."""

    name: str
    db: Path
    fail_rate: float
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> None:
        command = [sys.executable, "-m", f"mcp_saga.examples.{self.name}", "--http", str(self.port),
                   "--host", "127.0.0.1", "--db", str(self.db), "--fail-rate", str(self.fail_rate)]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        wait_until_accepting("127.0.0.1", self.port, self.proc, timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            _terminate(self.proc, grace=10)


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (Linux /proc): RQ forks its scheduler, which outlives a SIGKILLed parent."""
    parents: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(fields[1])].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _terminate(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Doomed:
    """A worker started to die between a call and its report; `died` once it did (wall clock)."""

    proc: subprocess.Popen[bytes]
    log: Path
    children: list[int] = field(default_factory=list)
    died: float | None = None


class Cluster:
    """Everything the run starts: Redis (AOF), three example servers, coordinators and workers."""

    def __init__(self, settings: Settings, workdir: Path, rng: random.Random, out: Out) -> None:
        self.settings, self.workdir, self.rng, self.out = settings, workdir, rng, out
        self.redis: RedisServer | None = None
        self.servers: dict[str, ExampleServer] = {}
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {"coordinator": [], "worker": []}
        self.spawned: Counter[str] = Counter()
        self.kills: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.busy_kills = 0
        self.crashes = 0
        self.doomed: list[Doomed] = []
        self._names: dict[int, str] = {}
        self.config = workdir / "saga.toml"

    def start(self) -> None:
        binary = find_redis_server()
        if binary is None:
            raise NoRedisError("the chaos run needs a redis-server binary")
        self.redis = RedisServer(binary, appendonly=True, directory=self.workdir / "redis")
        self.redis.directory.mkdir(exist_ok=True)
        self.redis.start()
        for name in SERVERS:
            db, log = self.workdir / f"{name}.db", self.workdir / f"{name}.log"
            self.servers[name] = ExampleServer(name, db, self.settings.fail_rate, log)
        for server in self.servers.values():
            server.start()
        self.config.write_text(self._config_text())
        for kind, count in (("coordinator", self.settings.coordinators), ("worker", self.settings.workers)):
            for _ in range(count):
                self.procs[kind].append(self._spawn(kind))

    @property
    def url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def _config_text(self) -> str:
        s = self.settings
        servers = "".join(
            f'[servers.{name}]\nurl = "{server.url}"\ntimeout = {s.call_timeout}\n\n'
            for name, server in self.servers.items()
        )
        return servers + (
            '[policy]\nauto = ["*"]\n\n[coordinator]\n'
            f"block_ms = 200\nclaim_idle_ms = {s.claim_idle_ms}\nwatchdog_after = {s.watchdog_after}\n"
            f"watchdog_every = 0.5\nbarrier_grace = {s.barrier_grace}\nretention_completed = {s.retention}\n"
            f"retention_compensated = {s.retention}\nretention_attention = {s.retention}\nidle_ttl = {s.idle_ttl}\n"
            "outcomes_maxlen = 100\ndead_letter_maxlen = 1000\n\n[worker]\n"
            f"attempts = {s.attempts}\nbackoff_base = {s.backoff_base}\nbackoff_max = {s.backoff_max}\n"
            f"lease = {s.lease}\njob_timeout = {s.job_timeout}\ntools_ttl = 5\n"
        )

    def _spawn(self, kind: str) -> subprocess.Popen[bytes]:
        self.spawned[kind] += 1
        n = self.spawned[kind]
        proc = saga_process(
            kind, "--name", f"chaos-{kind}-{n}", redis_url=self.url, config=self.config,
            env={"SAGA_LOG": "json"}, log=self.workdir / f"{kind}-{n}.log",
        )  # fmt: skip
        self._names[proc.pid] = f"chaos-{kind}-{n}"
        return proc

    def kill(self, kind: str) -> None:
        """SIGKILL one live process of `kind` and start a replacement, as a supervisor would.

        A worker is picked while it runs a compensation when one does within a second: an idle
        worker's death proves little.
        """
        procs = self.procs[kind]
        victim = self._busy_worker() if kind == "worker" else None
        busy = victim is not None
        victim = victim or self.rng.choice(procs)
        children = descendants(victim.pid)  # as a container or cgroup kill would, RQ's scheduler too
        victim.send_signal(signal.SIGKILL)
        _kill_all(children)
        victim.wait()
        procs[procs.index(victim)] = self._spawn(kind)
        self.kills[kind] += 1
        self.busy_kills += busy
        self.out(f"  SIGKILL {kind} (pid {victim.pid}{', mid-job' if busy else ''}); replacement started")

    def _busy_worker(self, within: float = 1.0) -> subprocess.Popen[bytes] | None:
        by_name = {self._names[p.pid]: p for p in self.procs["worker"]}
        r = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + within
        try:
            while time.monotonic() < deadline:
                for key in r.scan_iter(match="rq:worker:chaos-worker-*", count=1000):
                    name = key.decode().removeprefix("rq:worker:").split(".")[0]
                    if name in by_name and r.hget(key, "state") == b"busy":
                        return by_name[name]
                time.sleep(0.01)
        except redis.RedisError:
            pass
        finally:
            r.close()
        return None

    def restart_server(self, name: str) -> None:
        """Stop an example server (SIGTERM) and start it again on the same port with the same database."""
        server = self.servers[name]
        server.stop()
        server.start()
        self.restarts["server"] += 1
        self.out(f"  restarted MCP server {name} on port {server.port}")

    def restart_redis(self) -> None:
        """SIGTERM redis-server (it flushes the append-only file) and start it on the same port and dir."""
        assert self.redis is not None
        started = time.monotonic()
        self.redis.restart()
        self.restarts["redis"] += 1
        self.out(f"  restarted redis-server with AOF ({time.monotonic() - started:.2f} s down)")

    def spawn_doomed(self) -> None:
        """An extra worker that SIGKILLs itself right after its first compensation call returns.

        It arms the worker's fail point `worker.after-call` (runtime/failpoints.py): the call reached the
        server, the report never leaves, so the watchdog dispatches the same compensation again
        and only the idempotency key keeps the effect single. Random kills rarely land there.
        """
        n = len(self.doomed) + 1
        log = self.workdir / f"doomed-{n}.log"
        env = {"SAGA_LOG": "json", FAILPOINTS_ENV: "worker.after-call=kill"}
        proc = saga_process("worker", "--name", f"chaos-doomed-{n}", redis_url=self.url, config=self.config,
                            env=env, log=log)  # fmt: skip
        self.doomed.append(Doomed(proc, log))
        self.out(f"  started a worker that dies between its first call and its report (pid {proc.pid})")

    def crashed_jobs(self) -> list[tuple[str, str, float]]:
        """(workflow, step, when) of every job a doomed worker started before it died after a call."""
        jobs = []
        for doomed in self.doomed:
            if doomed.died is None or not doomed.log.exists():
                continue
            for match in re.finditer(r"saga: compensate ([^/\s]+)/(\S+): ", doomed.log.read_text(errors="replace")):
                jobs.append((match.group(1), match.group(2), doomed.died))
        return jobs

    def check(self) -> None:
        """A coordinator or worker that exited without being killed is a finding; restart it anyway."""
        for doomed in self.doomed:
            if doomed.proc.poll() is None:
                doomed.children = descendants(doomed.proc.pid)  # its scheduler, to stop once it is orphaned
            elif doomed.died is None and doomed.proc.returncode == -signal.SIGKILL:
                doomed.died = time.time()
                _kill_all(doomed.children)
                self.crashes += 1
        for kind, procs in self.procs.items():
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    self.unexpected.append(f"{kind} pid {proc.pid} exited with {proc.returncode}")
                    self.out(f"  ! {kind} pid {proc.pid} exited on its own ({proc.returncode}); restarting")
                    procs[i] = self._spawn(kind)

    def stop(self) -> None:
        for doomed in self.doomed:
            children = doomed.children + descendants(doomed.proc.pid)
            _terminate(doomed.proc)
            _kill_all(children)
        for procs in self.procs.values():
            for proc in procs:
                children = descendants(proc.pid)
                with contextlib.suppress(Exception):
                    _terminate(proc, grace=10)
                _kill_all(children)
        for server in self.servers.values():
            server.stop()
        if self.redis is not None:
            self.redis.stop()


# Watching Redis ---------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What Redis said about one workflow once it settled (taken before its retention expires)."""

    state: dict[str, str]
    comps: dict[str, dict[str, Any]]
    steps: int
    log: list[dict[str, str]]


class Tracker:
    """Reads the publishers' records as they are written and snapshots each workflow once it settles."""

    def __init__(self, r: redis.Redis, keys: Keys, paths: list[Path]) -> None:
        self.r, self.keys, self.paths = r, keys, paths
        self.offsets = {p: 0 for p in paths}
        self.records: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.last_settled = time.monotonic()

    def read(self) -> None:
        for path in self.paths:
            if not path.exists():
                continue
            with path.open() as f:
                f.seek(self.offsets[path])
                while (line := f.readline()).endswith("\n"):
                    self.offsets[path] = f.tell()
                    record = json.loads(line)
                    self.records[record["workflow"]] = record

    def waiting(self) -> list[str]:
        """Workflows whose terminal event was published and which have not settled yet."""
        return [w for w, rec in self.records.items() if rec["terminalPublished"] and w not in self.snapshots]

    def poll(self) -> None:
        self.read()
        self.follow_changes()
        waiting = self.waiting()
        if not waiting:
            return
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for workflow in waiting:
                    pipe.hget(self.keys.state(workflow), "status")
                statuses = pipe.execute()
            settled = [w for w, s in zip(waiting, statuses, strict=True) if s and s.decode() in TERMINAL]
            self.snapshots.update(self.snapshot(settled))
        except redis.ConnectionError:
            return  # Redis is restarting: look again on the next round
        if settled:
            self.last_settled = time.monotonic()

    def snapshot(self, workflows: list[str]) -> dict[str, Snapshot]:
        with self.r.pipeline(transaction=False) as pipe:
            for workflow in workflows:
                pipe.hgetall(self.keys.state(workflow))
                pipe.hgetall(self.keys.comp(workflow))
                pipe.llen(self.keys.steps(workflow))
                pipe.xrange(self.keys.log(workflow))
            replies = iter(pipe.execute())
        taken = {}
        for workflow in workflows:
            state, comps, steps, log = next(replies), next(replies), next(replies), next(replies)
            if not state:
                continue
            taken[workflow] = Snapshot(
                state={k.decode(): v.decode() for k, v in state.items()},
                comps={k.decode(): json.loads(v) for k, v in comps.items()},
                steps=steps,
                log=[{k.decode(): v.decode() for k, v in f.items()} for _, f in log],
            )
        return taken

    def follow_changes(self) -> None:
        """Snapshot again the settled workflows that changed since (a step claimed from a killed
        coordinator can land on a completed workflow), before their retention runs out."""
        names = list(self.snapshots)
        try:
            with self.r.pipeline(transaction=False) as pipe:
                for workflow in names:
                    pipe.hget(self.keys.state(workflow), "version")
                versions = pipe.execute()
            moved = [
                w
                for w, v in zip(names, versions, strict=True)
                if v is not None and v.decode() != self.snapshots[w].state.get("version")
            ]
            if moved:
                self.snapshots.update(self.snapshot(moved))
        except redis.ConnectionError:
            return  # Redis is restarting: look again on the next round

    def refresh(self) -> None:
        """Take the latest view of every snapshotted workflow still in Redis (a late event may have moved it)."""
        alive = [w for w in self.snapshots if self.r.exists(self.keys.state(w))]
        for i in range(0, len(alive), 200):
            self.snapshots.update(self.snapshot(alive[i : i + 200]))


def events_outstanding(r: redis.Redis, keys: Keys) -> int:
    """Entries of `saga:events` the coordinators have not acknowledged, or not read yet."""
    try:
        groups = r.xinfo_groups(keys.events)
    except redis.ResponseError:
        return 0
    return sum((g.get("pending") or 0) + (g.get("lag") or 0) for g in groups)


def footprint(r: redis.Redis, keys: Keys, ignore: frozenset[str] = frozenset()) -> dict[str, int]:
    """Memory and keys: what "back to baseline" is measured with.

    `ignore` names workflows whose orchestrator never published a terminal event: they stay
    `running` until `idle_ttl`, as documented, so their keys are not expected to expire here.
    """
    workflow_keys = 0
    for key in r.scan_iter(match=keys.workflow_pattern(), count=1000):
        tag = key.decode(errors="replace").partition("{")[2].rpartition("}")[0]
        workflow_keys += tag not in ignore
    rq_bytes = 0
    for key in r.scan_iter(match="rq:*", count=1000):
        rq_bytes += r.memory_usage(key, samples=0) or 0
    indexed = sum(r.zcard(keys.index(s)) for s in STATUSES) + r.zcard(keys.deadlines)
    # Redis 7 keeps a latency histogram (~25 kB) per command name ever run, which would count the
    # commands this run used, not its data: statistics only, reset before each measurement.
    r.config_resetstat()
    memory = r.info("memory")
    saga_bytes = sum(r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(match=f"{keys.prefix}:*", count=1000))
    return {
        "used_memory": int(memory["used_memory"]),
        "dataset": int(memory["used_memory_dataset"]),
        "overhead": int(memory["used_memory_overhead"]),
        "clients": int(memory.get("mem_clients_normal", 0)),
        "scripts": int(memory.get("used_memory_scripts", 0)),
        "saga_bytes": saga_bytes,
        "keys": int(r.dbsize()),
        "workflow_keys": workflow_keys,
        "indexed": indexed,
        "rq_bytes": rq_bytes,
        "events": r.xlen(keys.events),
    }


# Checking ---------------------------------------------------------------------------------------


def dead_letters(r: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    """Every dead-lettered entry: its type, workflow, step (when its data names one) and the reason."""
    entries = []
    for _, fields in r.xrange(keys.dead_letter):
        text = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
        step = ""
        with contextlib.suppress(ValueError, AttributeError):
            step = str(json.loads(text.get("data", "{}")).get("step", ""))
        entries.append({"type": text.get("type", ""), "workflow": text.get("workflow", ""), "step": step,
                        "reason": text.get(DEAD_REASON, "?")})  # fmt: skip
    return entries


def worker_log_events(workdir: Path) -> list[dict[str, Any]]:
    """The workers' JSON log lines about compensations (RQ's own plain lines are skipped)."""
    events = []
    for path in sorted(workdir.glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"compensation ' in line:
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
    return events


def verify(
    records: dict[str, dict[str, Any]],
    snapshots: dict[str, Snapshot],
    ledgers: dict[str, dict[str, Any]],
    worker_log: list[dict[str, Any]],
    dead: list[dict[str, str]],
    report: Report,
    crashed: list[tuple[str, str, float]] = (),  # type: ignore[assignment]
) -> None:
    """Every guarantee, checked against the servers' ledgers and the publishers' records."""
    violations = report.violations
    holdings: dict[str, tuple[str, dict[str, Any]]] = {}
    by_holding: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for server, ledger in ledgers.items():
        for holding in ledger["holdings"]:
            holdings[holding["id"]] = (server, holding)
        for effect in ledger["effects"]:
            by_holding[effect["holding"]].append(effect)
            if effect["tool"] in UNDO_TOOLS and effect["idempotencyKey"]:
                by_key[effect["idempotencyKey"]].append(effect)

    # Exactly once, from the ledgers alone: one undo per key, at most one undo per holding.
    for key, effects in by_key.items():
        if len(effects) > 1:
            report.double_effects += len(effects) - 1
            violations.append(f"idempotency key {key} applied {len(effects)} times: {effects}")
    for holding, effects in by_holding.items():
        undos = [e for e in effects if e["tool"] in UNDO_TOOLS]
        if len(undos) > 1 and len({e["idempotencyKey"] for e in undos}) > 1:
            report.double_effects += len(undos) - 1
            violations.append(f"holding {holding} undone {len(undos)} times under different keys")
        if any(not e["idempotencyKey"] for e in undos):
            violations.append(f"holding {holding} undone without an idempotency key")

    known: set[str] = set()
    statuses: Counter[str] = Counter()
    for workflow, record in sorted(records.items()):
        steps = record["steps"]
        known.update(s["holding"] for s in steps + record["unpublished"])
        report.steps += len(steps)
        if record["outcome"] == "completed":
            report.completed += 1
        else:
            report.failed += 1
        if not record["terminalPublished"]:
            statuses["(terminal event not published)"] += 1
            continue
        snap = snapshots.get(workflow)
        if snap is None:
            report.lost_events += 1 + len(steps)
            violations.append(f"{workflow}: no settled state in Redis ({record['outcome']}, {len(steps)} steps)")
            continue
        status = snap.state.get("status", "?")
        statuses[status] += 1
        recorded = snap.steps
        for step in steps:
            comp = snap.comps.get(step["step"])
            if comp is not None:
                # A step claimed from a killed coordinator after another one completed the workflow
                # is recorded as such: in the history, nothing to undo.
                report.late_steps += "after the workflow completed" in (comp.get("reason") or "")
                continue
            report.lost_events += 1
            violations.append(f"{workflow}: step {step['step']} was published but is not recorded")
        if recorded > len(steps) + len(record["unpublished"]):
            violations.append(f"{workflow}: {recorded} steps recorded, only {len(steps)} published")

        if record["outcome"] == "completed":
            if status != "completed":
                report.lost_events += status == "running"
                violations.append(f"{workflow}: completed by its orchestrator, but {status} in Redis")
            for step in steps:
                undos = [e for e in by_holding[step["holding"]] if e["tool"] in UNDO_TOOLS]
                _, holding = holdings.get(step["holding"], ("", None))
                if undos or holding is None or holding["status"] != FORWARD[step["tool"]][2]:
                    violations.append(f"{workflow}: holding {step['holding']} of a completed workflow was touched")
            continue

        if status not in ("compensated", "needs-attention"):
            report.lost_events += status == "running"
            violations.append(f"{workflow}: failed, but left {status}")
            continue
        if status == "needs-attention":
            reason = snap.state.get("attention", "")
            report.attention[workflow] = reason
            if not reason.strip():
                violations.append(f"{workflow}: needs-attention without a reason")
        flagged = "never recorded" in snap.state.get("attention", "")
        if record["unpublished"] and not flagged and recorded < len(steps) + len(record["unpublished"]):
            violations.append(f"{workflow}: a step's event was not published, but nothing flags it")
        for step in steps:
            comp = snap.comps.get(step["step"])
            undos = [e for e in by_holding[step["holding"]] if e["tool"] in UNDO_TOOLS]
            server, holding = holdings.get(step["holding"], (step["server"], None))
            if comp is None:
                violations.append(f"{workflow}: step {step['step']} has no compensation record")
            elif comp["status"] == "succeeded":
                if len(undos) != 1:
                    violations.append(f"{workflow}: step {step['step']} succeeded, but {len(undos)} undo effects")
                elif undos[0]["idempotencyKey"] != comp["idempotencyKey"]:
                    violations.append(f"{workflow}: step {step['step']} was undone under another key")
                elif holding is None or holding["status"] != UNDO[server][1]:
                    violations.append(f"{workflow}: holding {step['holding']} is not {UNDO[server][1]}")
                else:
                    report.compensations += 1
            elif status == "compensated":
                violations.append(f"{workflow}: compensated, but step {step['step']} is {comp['status']}")
            elif undos:
                report.compensations += 1  # applied, its report lost: the record says what a human must check
            else:
                report.left_for_human += 1
        # LIFO, from the servers' clocks: each undo applied after those of every later step.
        applied = [(e["at"], int(step["step"][1:])) for step in steps for e in by_holding[step["holding"]]
                   if e["tool"] in UNDO_TOOLS]  # fmt: skip
        order = [index for _, index in sorted(applied)]
        if order != sorted(order, reverse=True):
            report.out_of_order += 1
            violations.append(f"{workflow}: steps undone in the order {order}, not last-first")
        for comp in snap.comps.values():
            dispatched = sum(1 for e in snap.log if e.get("type") == "compensation-dispatched"
                             and e.get("step") == comp["step"])  # fmt: skip
            report.dispatches += dispatched
            report.redispatches += max(0, dispatched - 1)
    report.statuses = dict(statuses)

    # Effects nobody published: a call that failed at the client but ran at the server.
    for holding in holdings:
        if holding in known:
            continue
        report.unseen_effects += 1
        if any(e["tool"] in UNDO_TOOLS for e in by_holding[holding]):
            violations.append(f"holding {holding} was undone, but no orchestrator ever published it")

    # Repeats the key absorbed: successful calls beyond the first for one compensation.
    calls: Counter[tuple[str, str]] = Counter()
    for event in worker_log:
        msg = event.get("msg", "")
        if msg == "compensation succeeded":
            calls[(event.get("workflow", ""), event.get("step", ""))] += 1
        elif msg == "compensation skipped":
            report.duplicate_jobs_stopped += 1
        elif msg == "compensation failed":
            error = str(event.get("error", ""))
            if TRANSIENT_PREFIX in error:
                report.injected_errors += 1
            elif "Error executing tool" not in error:  # no answer: the server was restarting
                report.transport_errors += 1
    report.repeat_calls = sum(n - 1 for n in calls.values() if n > 1)

    # A worker that died between its call and its report: the call took effect (the ledger says so,
    # before the death), the compensation was dispatched again, and the key kept it to one effect.
    for workflow, step, died in crashed:
        comp = snapshots[workflow].comps.get(step) if workflow in snapshots else None
        effects = by_key.get(comp["idempotencyKey"], []) if comp else []
        if comp and comp["status"] == "succeeded" and len(effects) == 1 and effects[0]["at"] <= died:
            report.repeat_calls += 1
            report.crash_repeats += 1


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
    return sorted(plan)


def run_chaos(settings: Settings, out: Out = print) -> Report:
    """Run the whole thing and return what it found; never raises for a broken guarantee, reports it."""
    started = time.monotonic()
    seed = settings.seed if settings.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    workdir = Path(settings.workdir or tempfile.mkdtemp(prefix="saga-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(seed=seed, workdir=str(workdir))
    keys = Keys()
    cluster = Cluster(settings, workdir, rng, out)
    publishers: list[subprocess.Popen[bytes]] = []
    out(f"chaos run: {settings.workflows} workflows, {settings.publishers} publishers, seed {seed}, in {workdir}")
    try:
        cluster.start()
        r = redis.Redis.from_url(cluster.url)
        _wait(lambda: _group_exists(r, keys), 30, "the coordinators' consumer group")
        _wait(lambda: r.scard(f"rq:workers:{keys.queue}") >= settings.workers, 30, "the workers to register")
        before = footprint(r, keys)
        report.memory_before = before["used_memory"]

        paths = [workdir / f"publisher-{i}.jsonl" for i in range(settings.publishers)]
        ids = [f"chaos-{i % settings.publishers}-{i:05d}" for i in range(settings.workflows)]
        urls = {name: server.url for name, server in cluster.servers.items()}
        for i, path in enumerate(paths):
            spec = {"settings": asdict(settings), "redis": cluster.url, "urls": urls, "records": str(path),
                    "seed": seed, "workflows": ids[i :: settings.publishers]}  # fmt: skip
            spec_path = workdir / f"publisher-{i}.json"
            spec_path.write_text(json.dumps(spec))
            with open(workdir / f"publisher-{i}.log", "ab") as log:
                publishers.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.chaos", "--publish", str(spec_path)],
                    cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                ))  # fmt: skip

        tracker = Tracker(r, keys, paths)
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
                elif fault.startswith("server:"):
                    cluster.restart_server(fault.removeprefix("server:"))
                elif fault == "crash-after-call":
                    cluster.spawn_doomed()
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
        out(f"  publishers done ({len(tracker.records)} workflows recorded); waiting for quiescence")

        deadline = published_at + settings.settle_timeout
        tracker.poll()
        # Settled statuses are not enough: a step held by a killed coordinator is claimed later and
        # may still change a completed workflow's history. Quiet means nothing pending or unread too.
        while (tracker.waiting() or events_outstanding(r, keys)) and time.monotonic() < deadline:
            time.sleep(0.3)
            cluster.check()
            tracker.poll()
        tracker.refresh()
        report.settle_seconds = time.monotonic() - published_at
        for workflow in tracker.waiting():
            status = r.hget(keys.state(workflow), "status")
            out(f"  ! {workflow} did not settle: {status.decode() if status else 'no state'}")

        ledgers = {name: read_state(server.db) for name, server in cluster.servers.items()}
        dead = dead_letters(r, keys)
        for entry in dead:
            report.dead_letters[entry["reason"][:120]] = report.dead_letters.get(entry["reason"][:120], 0) + 1
        crashed = cluster.crashed_jobs()
        verify(tracker.records, tracker.snapshots, ledgers, worker_log_events(workdir), dead, report, crashed)
        report.workflows = len(tracker.records)
        if report.workflows != settings.workflows:
            report.violations.append(f"{settings.workflows - report.workflows} workflows have no publisher record")

        out(f"  verified; waiting up to {settings.expiry_timeout:.0f} s for retention expiry")
        deadline = time.monotonic() + settings.expiry_timeout
        unfinished = frozenset(w for w, rec in tracker.records.items() if not rec["terminalPublished"])
        after = footprint(r, keys, unfinished)
        while (after["workflow_keys"] or after["indexed"] > len(unfinished)) and time.monotonic() < deadline:
            time.sleep(1)
            cluster.check()
            after = footprint(r, keys, unfinished)
        report.memory_detail = {"before": before, "after": after}
        report.workflow_keys_after = after["workflow_keys"]
        report.memory_after, report.rq_bytes_after = after["used_memory"], after["rq_bytes"]
        if after["workflow_keys"]:
            report.violations.append(f"{after['workflow_keys']} per-workflow keys left after retention expiry")
        if after["indexed"] > len(unfinished):
            report.violations.append(f"{after['indexed']} index/deadline entries left after retention expiry")
        bound = before["used_memory"] + after["rq_bytes"] + settings.memory_slack
        if after["used_memory"] > bound:
            report.violations.append(
                f"Redis memory {after['used_memory']} B after expiry exceeds the baseline {before['used_memory']} B "
                f"+ RQ job records {after['rq_bytes']} B + slack {settings.memory_slack} B"
            )
        r.close()
    finally:
        for p in publishers:
            _terminate(p)
        cluster.stop()
        report.coordinator_kills = cluster.kills["coordinator"]
        report.worker_kills = cluster.kills["worker"]
        report.worker_kills_mid_job = cluster.busy_kills
        report.crashes_after_call = cluster.crashes
        report.server_restarts = cluster.restarts["server"]
        report.redis_restarts = cluster.restarts["redis"]
        report.unexpected_exits = len(cluster.unexpected)
        report.violations += [f"unexpected exit: {u}" for u in cluster.unexpected]
        report.wall_seconds = time.monotonic() - started
        if not settings.keep and report.ok and settings.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def _group_exists(r: redis.Redis, keys: Keys) -> bool:
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
    if report.violations:
        out(f"\n{len(report.violations)} GUARANTEE VIOLATION(S) (logs and ledgers kept in {report.workdir}):")
        for violation in report.violations[:50]:
            out(f"  - {violation}")
    else:
        out("\nevery guarantee held")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--publish"]:  # a publisher process, started by run_chaos
        asyncio.run(publish(json.loads(Path(argv[1]).read_text())))
        return 0
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--workflows", type=int, default=defaults.workflows)
    parser.add_argument("--publishers", type=int, default=defaults.publishers)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="workflows in flight each")
    parser.add_argument("--kills", type=int, default=defaults.kills, help="SIGKILLs of coordinators and of workers")
    parser.add_argument("--server-restarts", type=int, default=defaults.server_restarts)
    parser.add_argument("--redis-restarts", type=int, default=defaults.redis_restarts)
    parser.add_argument("--coordinators", type=int, default=defaults.coordinators)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--fail-share", type=float, default=defaults.fail_share, help="share of workflows failing")
    parser.add_argument("--fail-rate", type=float, default=defaults.fail_rate, help="transient compensation errors")
    parser.add_argument("--retention", type=int, default=defaults.retention, help="seconds settled workflows stay")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--workdir", help="keep processes' logs and ledgers here")
    parser.add_argument("--keep", action="store_true", help="keep the working directory even when all is well")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    settings = Settings(
        workflows=args.workflows, publishers=args.publishers, concurrency=args.concurrency, kills=args.kills,
        server_restarts=args.server_restarts, redis_restarts=args.redis_restarts,
        coordinators=args.coordinators, workers=args.workers, fail_share=args.fail_share, fail_rate=args.fail_rate,
        retention=args.retention, seed=args.seed, workdir=args.workdir, keep=args.keep,
    )  # fmt: skip
    report = run_chaos(settings)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
