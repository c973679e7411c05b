"""The processes a chaos run starts and the faults it inflicts on them (SIGKILL, SIGSTOP, restarts)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import redis
from mcp_saga.cli.procs import REPO, free_port, saga_process, wait_until_accepting
from mcp_saga.cli.redis_server import LocalCluster, NoRedisError, RedisServer, find_redis_server
from mcp_saga.runtime.failpoints import FAILPOINTS_ENV
from mcp_saga.schemas.config import (
    Config,
    CoordinatorSettings,
    Policy,
    RedisSettings,
    ServerConfig,
    WorkerSettings,
    write_config,
)
from mcp_saga.schemas.keys import Keys
from redis.cluster import RedisCluster

from bench.chaos.model import SERVERS, Out, Settings

# Forward tools the run's config declares idempotent under the forward key (see Cluster._config).
IDEMPOTENT = {"inventory": ["reserve_inventory"], "shipping": ["create_shipment"]}

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
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # black-holed: let it see the SIGTERM
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
    """Everything the run starts: Redis (AOF), three example servers, coordinators and workers.

    With `settings.redis_cluster`, Redis is a local Redis Cluster (three primaries, a replica each)
    holding events and state, and RQ's queue a standalone redis-server beside it, as README
    "Running on Redis Cluster" deploys it.
    """

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
        self.stalls: Counter[str] = Counter()
        self._stopped: list[tuple[float, list[int], float]] = []  # (when to resume, pids, since when)
        self.stall_windows: list[float] = []  # how long each SIGSTOP really lasted (s)
        self._names: dict[int, str] = {}
        self.blackholes = 0
        self.fills = 0
        self.oom_refusals = 0  # commands Redis refused with OOM while full (INFO errorstats)
        self._full_until: float | None = None
        self._full_since: float | None = None
        self._full_down = 0.0  # seconds of the current fill Redis spent restarting (not full, down)
        self.full_windows: list[float] = []  # how long each fill really held Redis full (s)
        # The timer thread ends stalls and fills on time, whatever the fault loop is blocked in (an
        # MCP server restart took 11 s in a reduced run, a stall meant to last 6 s lasted over 11,
        # and a full run kept Redis full from its fill until the publishers were done). One lock
        # for the stopped processes, one for Redis's limit and restarts: a Redis restart never
        # delays a SIGCONT.
        self._stall_lock = threading.Lock()
        self._redis_lock = threading.RLock()
        self._timer_stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.config = workdir / "saga.toml"
        self.redis_cluster: LocalCluster | None = None
        self.queue: RedisServer | None = None  # RQ's standalone Redis, on a cluster
        self.failovers: list[tuple[float, float, set[int]]] = []  # (killed, healthy, slots), wall clock

    def start(self) -> None:
        binary = find_redis_server()
        if binary is None:
            raise NoRedisError("the chaos run needs a redis-server binary")
        if self.settings.redis_cluster:
            self.redis_cluster = LocalCluster(binary).start()
            self.queue = RedisServer(binary, directory=self.workdir / "queue")
            self.queue.directory.mkdir(exist_ok=True)
            self.queue.start()
        else:
            self.redis = RedisServer(binary, appendonly=True, directory=self.workdir / "redis")
            self.redis.directory.mkdir(exist_ok=True)
            self.redis.start()
        for name in SERVERS:
            db, log = self.workdir / f"{name}.db", self.workdir / f"{name}.log"
            self.servers[name] = ExampleServer(name, db, self.settings.fail_rate, log)
        for server in self.servers.values():
            server.start()
        write_config(self._config(), self.config)
        for kind, count in (("coordinator", self.settings.coordinators), ("worker", self.settings.workers)):
            for _ in range(count):
                self.procs[kind].append(self._spawn(kind))
        self.start_timer()

    def start_timer(self, every: float = 0.05) -> None:
        """End due stalls and fills from a thread of its own, every `every` seconds, until `stop()`."""

        def loop() -> None:
            while not self._timer_stop.wait(every):
                self.restore()

        self._timer = threading.Thread(target=loop, name="chaos-timer", daemon=True)
        self._timer.start()

    def restore(self) -> None:
        """SIGCONT the stalled processes whose time is up, and lift a fill whose time is up."""
        self.resume()
        with self._redis_lock:
            if self._full_until is not None and time.monotonic() >= self._full_until:
                self.unfill_redis()

    @property
    def url(self) -> str:
        if self.redis_cluster is not None:
            return self.redis_cluster.url
        assert self.redis is not None
        return self.redis.url

    @property
    def keys(self) -> Keys:
        return Keys(partitions=self.settings.partitions if self.settings.redis_cluster else 1)

    def redis_settings(self) -> RedisSettings:
        """The config's `[redis]` table: the defaults, or the cluster's with its queue."""
        if self.queue is None:
            return RedisSettings()
        return RedisSettings(cluster=True, queue_url=self.queue.url, partitions=self.settings.partitions)

    def client(self) -> redis.Redis | RedisCluster:
        """A client for events and state: redis-py's cluster client follows MOVED and failovers itself."""
        if self.redis_cluster is not None:
            return RedisCluster.from_url(self.url)
        return redis.Redis.from_url(self.url)

    def queue_client(self) -> redis.Redis:
        """A client of the Redis that holds RQ's queue and its workers' records."""
        return redis.Redis.from_url(self.queue.url if self.queue is not None else self.url)

    def kill_primary(self) -> None:
        """SIGKILL the primary that holds a partition's events stream, and wait for its replica to take over.

        Not restarted: without persistence a restarted node comes back empty, and the run goes on
        with one primary that has no replica, as a cluster does until its operator replaces the node.
        The wall-clock window and the node's slots are kept: the verifier counts what the failover
        lost (writes the primary acknowledged and had not sent to its replica yet).
        """
        assert self.redis_cluster is not None
        part = self.rng.randrange(self.settings.partitions)
        with contextlib.closing(RedisCluster.from_url(self.url)) as client:
            node = client.get_node_from_key(self.keys.on(part).events)
        victim = next(n for n in self.redis_cluster.nodes if n.port == int(node.port))
        slots = _slots_of(victim.port)
        began = time.time()
        victim.stop(kill=True)
        # The other nodes go on saying `cluster_state:ok` until they notice the death (node timeout):
        # the failover is over once a live primary serves the victim's slots and the cluster is healthy.
        _wait_promoted(self.redis_cluster, victim, slots, 60)
        self.redis_cluster.wait_healthy(60)
        ended = time.time()
        self.failovers.append((began, ended, slots))
        self.restarts["primary"] += 1
        self.out(f"  SIGKILL cluster primary :{victim.port} (partition {part}'s stream); its replica took over "
                 f"after {ended - began:.1f} s")  # fmt: skip

    def _config(self) -> Config:
        """mcp-saga's timeouts shortened so that the watchdog, claims and leases all get exercised."""
        s = self.settings
        return Config(
            # Every example forward tool returns its first result for a repeated forward key; inventory and
            # shipping are declared idempotent so, payments not: an unconfirmed charge is left in doubt,
            # an unconfirmed reservation or shipment is recalled and undone.
            servers={
                n: ServerConfig(url=server.url, timeout=s.call_timeout, idempotent=IDEMPOTENT.get(n, []))
                for n, server in self.servers.items()
            },
            policy=Policy(auto=["*"]),
            coordinator=CoordinatorSettings(
                block_ms=200, claim_idle_ms=s.claim_idle_ms, watchdog_after=s.watchdog_after, watchdog_every=0.5,
                barrier_grace=s.barrier_grace, retention_completed=s.retention, retention_compensated=s.retention,
                retention_attention=s.retention, idle_ttl=s.idle_ttl, outcomes_maxlen=100, dead_letter_maxlen=1000,
                in_doubt_after=s.in_doubt_after,
            ),
            redis=self.redis_settings(),
            worker=WorkerSettings(
                attempts=s.attempts, backoff_base=s.backoff_base, backoff_max=s.backoff_max, lease=s.lease,
                job_timeout=s.job_timeout, tools_ttl=5,
            ),
        )  # fmt: skip

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

    def stall(self, kind: str) -> None:
        """SIGSTOP one live process of `kind` (a worker while it runs a compensation, when one does)
        and SIGCONT it `stall_seconds` later: a process that hangs and comes back, not one that dies."""
        victim = (self._busy_worker() if kind == "worker" else None) or self.rng.choice(self.procs[kind])
        pids = [victim.pid, *descendants(victim.pid)]
        with self._stall_lock:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            now = time.monotonic()
            self._stopped.append((now + self.settings.stall_seconds, pids, now))
        self.stalls[kind] += 1
        self.out(f"  SIGSTOP {kind} (pid {victim.pid}) for {self.settings.stall_seconds:g} s")

    def resume(self, everything: bool = False) -> None:
        """SIGCONT the stalled processes whose time is up (all of them when stopping)."""
        with self._stall_lock:
            now = time.monotonic()
            for entry in list(self._stopped):
                if everything or now >= entry[0]:
                    for pid in entry[1]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGCONT)
                    self._stopped.remove(entry)
                    if not everything:
                        self.stall_windows.append(now - entry[2])

    def _busy_worker(self, within: float = 1.0) -> subprocess.Popen[bytes] | None:
        by_name = {self._names[p.pid]: p for p in self.procs["worker"]}
        r = self.queue_client()
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
        started = time.monotonic()
        server.stop()
        server.start()
        self.restarts["server"] += 1
        self.out(f"  restarted MCP server {name} on port {server.port} ({time.monotonic() - started:.2f} s)")

    def restart_redis(self) -> None:
        """SIGTERM redis-server (it flushes the append-only file) and start it on the same port and dir.

        A fill in progress is carried over: a restart forgets the limit and the error counts, so
        they are counted before and the limit is set again after, for the time the fill had left.
        """
        assert self.redis is not None
        with self._redis_lock:
            full = self._full_until is not None
            if full:
                self.unfill_redis(carry=True)
            started = time.monotonic()
            self.redis.restart()
            down = time.monotonic() - started
            self.restarts["redis"] += 1
            self.out(f"  restarted redis-server with AOF ({down:.2f} s down)")
            if full:
                self._full_down += down
                self.fill_redis(carry=True)

    def blackhole_server(self, name: str) -> None:
        """SIGSTOP an example server for `stall_seconds`: its port still accepts, nothing answers.

        Worker calls to it hang until their timeout (an attempt used, retried with backoff), and
        the publishers' calls to it fail at theirs; the other servers' compensations must go on.
        """
        server = self.servers[name]
        assert server.proc is not None
        with self._stall_lock:
            os.kill(server.proc.pid, signal.SIGSTOP)
            now = time.monotonic()
            self._stopped.append((now + self.settings.stall_seconds, [server.proc.pid], now))
        self.blackholes += 1
        self.out(f"  black-holed MCP server {name} (SIGSTOP) for {self.settings.stall_seconds:g} s")

    def fill_redis(self, *, carry: bool = False) -> None:
        """Set `maxmemory` just above what Redis uses now, for `full_seconds`: writes fail with OOM.

        The policy stays `noeviction` (the coordinator refuses an evicting one), so nothing is
        destroyed; coordinators and workers must back off without acknowledging, and carry on
        once the limit is lifted. `carry`: the same fill again after a restart, its window unchanged.
        """
        with self._redis_lock:
            r = redis.Redis.from_url(self.url)
            try:
                r.config_resetstat()
                used = int(r.info("memory")["used_memory"])
                r.config_set("maxmemory", used + self.settings.full_margin)
            finally:
                r.close()
            if not carry:
                self._full_since = time.monotonic()
                self._full_until = self._full_since + self.settings.full_seconds
                self.fills += 1
            left = max(0.0, (self._full_until or 0.0) - time.monotonic())
            self.out(f"  Redis maxmemory set to {used + self.settings.full_margin} B for {left:.1f} s")

    def unfill_redis(self, *, carry: bool = False) -> bool:
        """Lift the limit of `fill_redis`; False if Redis did not take it (the timer tries again).

        The fill ends (and its window is measured) only once Redis says `maxmemory` is 0; `carry`:
        lifted for a restart, to be set again (`restart_redis`), so the fill goes on.
        """
        with self._redis_lock:
            r = redis.Redis.from_url(self.url)
            try:
                r.config_set("maxmemory", 0)
                if int(r.config_get("maxmemory")["maxmemory"]) != 0:
                    return False
                if not carry:
                    self._end_fill()
                self.oom_refusals += int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
                r.config_resetstat()
            except redis.RedisError:
                return False
            finally:
                r.close()
            if not carry:
                self.out(f"  Redis maxmemory lifted after {self.full_windows[-1]:.1f} s")
            return True

    def _end_fill(self) -> None:
        """The fill is over: how long Redis was held full (a restart's time down not counted)."""
        if self._full_since is not None:
            self.full_windows.append(time.monotonic() - self._full_since - self._full_down)
        self._full_until = self._full_since = None
        self._full_down = 0.0

    def wipe_redis(self) -> tuple[float, float]:
        """Stop redis-server, delete its append-only file, start it empty: everything in flight is lost.

        Returns the wall-clock window of the outage; the verifier then expects the workflows in
        flight during it to be lost (and counts them), rather than flagging them.
        """
        assert self.redis is not None
        with self._redis_lock:
            began = time.time()
            self.redis.stop()
            for path in self.redis.directory.iterdir():
                if path.name != "redis.log":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.redis.start()
            if self._full_until is not None:  # an empty server starts without the limit: the fill ends
                self._end_fill()
            ended = time.time()
        self.restarts["wipe"] += 1
        self.out(f"  restarted redis-server WITHOUT its data ({ended - began:.2f} s down)")
        return began, ended

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
        self.restore()
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
        self._timer_stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
        self.resume(everything=True)
        if self._full_until is not None:
            self.unfill_redis()
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
        if self.redis_cluster is not None:
            self.redis_cluster.cleanup()  # its nodes' directories are temporary ones
        if self.queue is not None:
            self.queue.stop()


def _wait_promoted(cluster: LocalCluster, victim: RedisServer, slots: set[int], timeout: float) -> None:
    """Until a live node other than `victim` serves one of `slots` as a primary."""
    deadline = time.monotonic() + timeout
    probe = min(slots)
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node is victim or node.process is None or node.process.poll() is not None:
                continue
            with contextlib.suppress(redis.RedisError):
                if probe in _slots_of(node.port):
                    return
        time.sleep(0.1)
    raise NoRedisError(f"no replica took over the slots of :{victim.port} within {timeout:g} s")


def _slots_of(port: int) -> set[int]:
    """The slots the node on `port` serves as a primary (CLUSTER NODES, as that node sees itself)."""
    with redis.Redis(port=port) as node:
        lines = node.execute_command("CLUSTER", "NODES")
    text = lines.decode() if isinstance(lines, bytes) else str(lines)
    slots: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        if "myself" in fields[2] and "master" in fields[2]:
            for part in fields[8:]:
                if part.startswith("["):
                    continue  # a slot being migrated
                first, _, last = part.partition("-")
                slots.update(range(int(first), int(last or first) + 1))
    return slots
