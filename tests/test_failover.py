"""Sentinel failover with real processes: the primary is SIGKILLed mid-unwind and everything follows.

A primary with two replicas and a Sentinel (tests/sentinels.py); the coordinator, the worker and
the SDK are all given the same `redis+sentinel://` URL. A probe publisher writes events steadily
through the failover and counts the acknowledged ones the promoted replica does not have: with
`[redis] wait_replicas = 1` that must be none; without, the test prints what was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx2
import pytest
import redis
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_saga.examples.ledger import read_state
from mcp_saga.runtime.connect import connect
from mcp_saga.runtime.durability import Durability
from mcp_saga.runtime.publish import Publisher
from mcp_saga.schemas.config import Config, RedisSettings, dump_config, parse_config
from mcp_saga.schemas.events import WorkflowCompleted
from mcp_saga.schemas.keys import Keys
from processes import free_port, log_tails, saga_process, start_http_server, stop_all, wait_for, wait_until_accepting
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from sentinels import SentinelGroup, sentinel_group

import mcp_saga

K = Keys()
TOKEN = "failover-token-" + "x" * 16
LAG = 0.3  # seconds the replication links stall before the primary is killed
PROBE = Keys("probe")  # the probe's stream: no coordinator reads or trims it, so every entry stays to be counted


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with sentinel_group(tmp_path / "redis", replicas=2) as started:
        yield started


def client_for(url: str) -> redis.Redis:
    """Retries that outlast a failover (about 2-4 s here), as every saga process has."""
    return connect(url, RedisSettings(), retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 20))


class Probe(threading.Thread):
    """Publishes workflow-completed events one after another; keeps the ids Redis acknowledged."""

    def __init__(self, url: str, durability: Durability | None, client: Any = None) -> None:
        super().__init__(daemon=True)
        self.publisher = Publisher(client or client_for(url), "probe", durability=durability)
        self.acknowledged: list[str] = []
        self.refused = 0
        self.halt = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.halt.is_set():
            n += 1
            try:
                self.acknowledged.append(self.publisher.publish(f"probe-{n}", WorkflowCompleted()))
            except redis.RedisError:  # not acknowledged: the probe does not count it
                self.refused += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        self.publisher.redis.close()

    def missing(self, r: redis.Redis) -> list[str]:
        present = {i.decode() for i, _ in r.xrange(PROBE.events)}
        return [i for i in self.acknowledged if i not in present]


class Measured(NamedTuple):
    probe: Probe
    missing: list[str]
    held_from: int  # how many were acknowledged when the replication links stalled
    during_stall: int  # acknowledged while they stalled

    def line(self, label: str) -> str:
        return (
            f"{label}: {len(self.probe.acknowledged)} acknowledged ({self.during_stall} during the {LAG} s stall), "
            f"{self.probe.refused} refused, {len(self.missing)} acknowledged events lost"
        )


def probe_through_failover(group: SentinelGroup, durability: Durability | None) -> Measured:
    """Steady publishing; the replication links stall for a moment, the primary dies, a replica is promoted.

    The stall is the lag a slow or broken link gives a replica; without it, a SIGKILL on loopback
    almost always finds the replicas holding every write (see README "Failover" for both figures).
    """
    probe = Probe(group.url, durability)
    probe.start()
    wait_for(lambda: len(probe.acknowledged) >= 200, 30, "the probe to publish")
    with group.links_held():
        held_from = len(probe.acknowledged)
        time.sleep(LAG)
        old = group.kill_primary()
        during = len(probe.acknowledged) - held_from
    before = len(probe.acknowledged)
    group.wait_for_promotion(old)
    wait_for(lambda: len(probe.acknowledged) >= before + 100, 60, "the probe to publish on the new primary")
    probe.stop()
    r = client_for(group.url)
    try:
        return Measured(probe, probe.missing(r), held_from, during)
    finally:
        r.close()


def test_with_wait_no_acknowledged_event_is_lost_in_a_failover(group: SentinelGroup) -> None:
    measured = probe_through_failover(group, Durability(replicas=1, timeout_ms=200))
    print(measured.line("with WAIT"))
    assert measured.missing == []


def test_without_wait_a_failover_loses_what_the_lagging_replica_had_not_received(group: SentinelGroup) -> None:
    """Asynchronous replication: what the primary acknowledged while its replicas lagged dies with it.

    How many that is follows the publishing rate and the lag; the test asserts that what was
    acknowledged during the stall was lost, as one run of the latest writes before the kill, and
    that the publisher followed the promotion; it prints the figure README "Failover" quotes.
    Before the stall the replicas lag too, by however far replication trails on a loaded machine
    (60 events, some 7 ms, seen under a full suite): that tail is lost with the rest, so the run
    may start a little before the stall, but not a whole stall's length before it.
    """
    measured = probe_through_failover(group, None)
    print(measured.line("without WAIT"))
    acknowledged = measured.probe.acknowledged
    assert measured.missing
    first = acknowledged.index(measured.missing[0])
    lost_run = acknowledged[first : first + len(measured.missing)]
    assert measured.missing == lost_run  # the latest writes, none kept among them
    held = acknowledged[measured.held_from + 1 : measured.held_from + measured.during_stall]
    assert set(held) <= set(measured.missing)  # the stall's writes died with the primary (+1: the one in flight)
    assert measured.held_from - first <= measured.during_stall  # a lag shorter than the stall before it
    assert acknowledged[-1] not in measured.missing  # it goes on on the new primary


# The unwind -------------------------------------------------------------------------------------

WORKFLOWS, STEPS = 4, 3


def config_toml(tmp_path: Path, payments: str, wait_replicas: int, gateway_port: int) -> tuple[Path, Config]:
    config = parse_config(
        {
            "servers": {"payments": {"url": payments, "timeout": 5}},
            "gateway": {"port": gateway_port, "token_env": "GW_TOKEN", "tools": True},
            "coordinator": {"block_ms": 100, "claim_idle_ms": 1000, "barrier_grace": 5, "watchdog_after": 4},
            "worker": {
                "backoff_base": 0.1,
                "backoff_max": 2,
                "jitter": 0,
                "lease": 5,
                "concurrency": 2,
                "attempts": 10,
            },
            "redis": {"wait_replicas": wait_replicas, "wait_timeout_ms": 500},
        }
    )
    path = tmp_path / "saga.toml"
    path.write_text(dump_config(config))
    return path, config


async def failing_workflow(
    workflow: str, url: str, payments: str, config: Any, after_first: Callable[[], Awaitable[None]] | None = None
) -> None:
    """STEPS charges, then a failure; `after_first` runs once the first step is confirmed written."""
    async with Client(payments) as client:
        with pytest.raises(RuntimeError, match="fell through"):
            async with mcp_saga.workflow(workflow, redis=url, servers={"payments": client}, config=config) as wf:
                for n in range(STEPS):
                    await wf.call("payments", "charge_payment", {"orderId": f"{workflow}/{n}", "amount": 1.0})
                    if n == 0 and after_first is not None:
                        await wf.flush()
                        await after_first()
                raise RuntimeError("the order fell through")


async def gateway_workflow(workflow: str, gateway: str) -> None:
    """Three charges and `saga_fail` through the gateway; a call it refuses while Redis is away is made again."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Saga-Workflow": workflow}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(f"{gateway}/mcp/payments", http_client=http)) as client,
    ):
        for n in range(STEPS):
            for _ in range(100):
                result = await client.call_tool("charge_payment", {"orderId": f"{workflow}/{n}", "amount": 1.0})
                if not result.is_error:
                    break
                await asyncio.sleep(0.2)  # refused: the gateway could not have recorded it
            assert not result.is_error, result
        assert not (await client.call_tool("saga_fail", {"reason": "the order fell through"})).is_error


def status(r: redis.Redis, workflow: str) -> str | None:
    raw = r.hget(K.state(workflow), "status")
    return raw.decode() if raw else None


def logs(tmp_path: Path, group: SentinelGroup) -> str:
    parts = [
        f"--- {name}\n{(tmp_path / name).read_text(errors='replace')[-3000:]}"
        for name in ("coordinator.log", "worker.log", "gateway.log")
        if (tmp_path / name).exists()
    ]
    return "\n".join([*parts, f"--- sentinel\n{group.sentinel_log()}"])


def refunds(ledger: Path) -> list[dict]:
    return [e for e in read_state(ledger)["effects"] if e["tool"] == "refund_payment"]


@pytest.mark.timeout(240)
def test_an_unwind_in_flight_finishes_last_first_through_a_sentinel_failover(
    group: SentinelGroup, tmp_path: Path
) -> None:
    """SIGKILL the primary while several unwinds run; Sentinel promotes a replica; all of them finish.

    The coordinator, the worker and the gateway follow the new primary (the Sentinel URL; READONLY
    or a refused connection is an outage they wait out); a workflow the SDK writes on both sides of
    the failover and one through the gateway after it are unwound too, and `saga inspect` reads the
    result through the same URL; each order's charges are refunded exactly once, newest first.
    With WAIT on, the coordinator dispatches nothing the replica has not confirmed.
    """
    ledger = tmp_path / "payments.db"
    with start_http_server("mcp_saga.examples.payments", "--db", str(ledger), "--delay", "0.3") as (_, payments):
        port = free_port()
        path, config = config_toml(tmp_path, payments, wait_replicas=1, gateway_port=port)
        env = {"GW_TOKEN": TOKEN}
        procs = [
            saga_process("coordinator", redis_url=group.url, config=path, log=tmp_path / "coordinator.log"),
            saga_process("worker", redis_url=group.url, config=path, log=tmp_path / "worker.log"),
            saga_process("gateway", redis_url=group.url, config=path, env=env, log=tmp_path / "gateway.log"),
        ]
        try:
            names = [f"order-{n}" for n in range(WORKFLOWS)]

            async def before() -> None:
                await asyncio.gather(*(failing_workflow(w, group.url, payments, config) for w in names))

            wait_until_accepting("127.0.0.1", port, procs[2])
            asyncio.run(before())
            # One SDK workflow spans the failover: its first step on the old primary, the rest and its
            # failure through the same connection pool on the new one.
            first_written, promoted = threading.Event(), threading.Event()

            async def across_the_failover() -> None:
                first_written.set()
                assert await asyncio.to_thread(promoted.wait, 120)

            across = threading.Thread(
                target=lambda: asyncio.run(
                    failing_workflow("order-across", group.url, payments, config, across_the_failover)
                )
            )
            across.start()
            assert first_written.wait(60)
            wait_for(lambda: refunds(ledger), 60, "the first refund")
            old = group.kill_primary()
            assert len(refunds(ledger)) < WORKFLOWS * STEPS  # the unwinds are still in flight
            group.wait_for_promotion(old)
            promoted.set()
            across.join(120)
            assert not across.is_alive()
            # The gateway's connection was to the dead primary: its calls go through again.
            asyncio.run(gateway_workflow("order-gateway", f"http://127.0.0.1:{port}"))
            names += ["order-across", "order-gateway"]
            r = client_for(group.url)
            wait_for(
                lambda: all(status(r, w) == "compensated" for w in names),
                120,
                f"every unwind to finish: {[status(r, w) for w in names]}\n{logs(tmp_path, group)}",
            )
            assert all(p.poll() is None for p in procs), logs(tmp_path, group)
            inspect = saga_process(
                "inspect", "order-gateway", redis_url=group.url, config=path, log=tmp_path / "cli.log"
            )
            assert inspect.wait(60) == 0, (tmp_path / "cli.log").read_text()
            assert "compensated" in (tmp_path / "cli.log").read_text()
        finally:
            stop_all(*procs)

    state = read_state(ledger)
    order_of = {h["id"]: h["data"]["orderId"] for h in state["holdings"] if h["kind"] == "charge"}
    refunded = [order_of[e["holding"]] for e in refunds(ledger)]
    assert len(refunded) == len(set(refunded)) == len(names) * STEPS, refunded  # each once, none twice
    for workflow in names:
        mine = [o for o in refunded if o.startswith(f"{workflow}/")]
        assert mine == [f"{workflow}/{n}" for n in reversed(range(STEPS))], (workflow, mine)


# The same on Redis Cluster -------------------------------------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[Any]:
    """A cluster of the test's own: the test kills one of its primaries for good."""
    from clusters import cluster_setup

    with cluster_setup() as setup:
        yield setup


@pytest.mark.timeout(240)
def test_an_unwind_in_flight_finishes_last_first_when_a_cluster_primary_dies(own_cluster: Any, tmp_path: Path) -> None:
    """SIGKILL the primary holding a failing workflow's keys mid-unwind; its replica takes the slots over.

    The coordinator's and the SDK's RedisCluster clients follow MOVED to the promoted replica; the
    queue lives on its own standalone Redis, as RQ needs. Every unwind finishes, newest step first,
    each charge refunded once.
    """
    setup = own_cluster
    ledger = tmp_path / "payments.db"
    with start_http_server("mcp_saga.examples.payments", "--db", str(ledger), "--delay", "0.3") as (_, payments):
        config = parse_config(
            {
                "servers": {"payments": {"url": payments, "timeout": 5}},
                "coordinator": {"block_ms": 100, "claim_idle_ms": 1000, "barrier_grace": 5, "watchdog_after": 4},
                "worker": {
                    "backoff_base": 0.1,
                    "backoff_max": 2,
                    "jitter": 0,
                    "lease": 5,
                    "concurrency": 2,
                    "attempts": 10,
                },
                "redis": setup.redis_settings(partitions=3),
            }
        )
        path = tmp_path / "saga.toml"
        path.write_text(dump_config(config))
        procs = [
            saga_process("coordinator", redis_url=setup.url, config=path, log=tmp_path / "coordinator.log"),
            saga_process("worker", redis_url=setup.url, config=path, log=tmp_path / "worker.log"),
        ]
        keys = config.keys()
        try:
            names = [f"cluster-order-{n}" for n in range(WORKFLOWS)]

            async def run_all() -> None:
                await asyncio.gather(*(failing_workflow(w, setup.url, payments, config) for w in names))

            asyncio.run(run_all())
            wait_for(lambda: refunds(ledger), 60, "the first refund")
            victim = setup.primary_of(keys.state(names[0]))
            victim.stop(kill=True)
            assert len(refunds(ledger)) < WORKFLOWS * STEPS  # the unwinds are still in flight
            setup.cluster.wait_healthy(60)

            def statuses() -> list[str | None]:
                alive = next(n.url for n in setup.cluster.nodes if n is not victim)
                try:  # the topology as it is now: until the replica takes over, its slots are unreachable
                    with contextlib.closing(RedisCluster.from_url(alive)) as fresh:
                        return [(fresh.hget(keys.state(w), "status") or b"").decode() or None for w in names]
                except redis.RedisError:
                    return []

            try:
                wait_for(lambda: statuses() == ["compensated"] * WORKFLOWS, 120, "every unwind")
            except AssertionError as exc:
                logs = log_tails(tmp_path / "coordinator.log", tmp_path / "worker.log")
                raise AssertionError(f"{exc}: {statuses()}, refunds {len(refunds(ledger))}\n{logs}") from None
            assert all(p.poll() is None for p in procs)
        finally:
            stop_all(*procs)
    state = read_state(ledger)
    order_of = {h["id"]: h["data"]["orderId"] for h in state["holdings"] if h["kind"] == "charge"}
    refunded = [order_of[e["holding"]] for e in refunds(ledger)]
    assert len(refunded) == len(set(refunded)) == WORKFLOWS * STEPS, refunded
    for workflow in names:
        assert [o for o in refunded if o.startswith(f"{workflow}/")] == [f"{workflow}/{n}" for n in (2, 1, 0)]


@pytest.fixture
def own_cluster_of_two_replicas() -> Iterator[Any]:
    """Two replicas per primary: once one is promoted, the other confirms its writes (WAIT 1)."""
    from clusters import cluster_setup

    with cluster_setup(replicas=2) as setup:
        yield setup


def test_with_wait_no_acknowledged_event_is_lost_when_a_cluster_primary_dies(own_cluster_of_two_replicas: Any) -> None:
    """The probe of the Sentinel tests on the cluster: its stream's primary is SIGKILLed, the replica
    promoted; with `wait_replicas = 1` every acknowledged event is on it, and the publisher follows
    the new topology (runtime/durability.py `Writes`). The cluster has no stalled links to offer, so
    unlike the Sentinel pair this test does not measure what is lost without WAIT."""
    setup = own_cluster_of_two_replicas
    probe = Probe(setup.url, Durability(replicas=1, timeout_ms=200), client=RedisCluster.from_url(setup.url))
    probe.start()
    wait_for(lambda: len(probe.acknowledged) >= 200, 30, "the probe to publish")
    victim = setup.primary_of(PROBE.events)
    victim.stop(kill=True)
    before = len(probe.acknowledged)
    setup.cluster.wait_healthy(60)
    try:
        wait_for(lambda: len(probe.acknowledged) >= before + 100, 60, "the probe to publish on the promoted replica")
    finally:
        probe.stop()
    alive = next(n.url for n in setup.cluster.nodes if n is not victim)
    with contextlib.closing(RedisCluster.from_url(alive)) as fresh:
        missing = probe.missing(fresh)
    assert setup.primary_of(PROBE.events) is not victim
    print(f"cluster, with WAIT: {len(probe.acknowledged)} acknowledged, {probe.refused} refused, {len(missing)} lost")
    assert missing == []
