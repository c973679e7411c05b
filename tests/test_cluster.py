"""Redis Cluster: partitioned events and state on a real local cluster, with real processes.

The cluster is six `redis-server --cluster-enabled yes` processes joined by `redis-cli --cluster
create` (3 primaries, 3 replicas), started once for the module, plus a standalone Redis for RQ's
queue. The end-to-end test runs two coordinators, a worker and the gateway as `saga` processes,
the example MCP servers over streamable HTTP, and the Python SDK: workflows of every partition
fail and are undone in LIFO order; the operator commands gather across partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
import redis.asyncio
from mcp import Client
from mcp_saga.cli.main import main
from mcp_saga.examples import SERVERS
from mcp_saga.examples.ledger import read_state
from mcp_saga.runtime import publish
from mcp_saga.runtime.connect import evaluate
from mcp_saga.runtime.durability import Durability, NotReplicated, Writes
from mcp_saga.runtime.publish import AsyncPublisher, Publisher
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.events import WORKFLOW_META_KEY, WorkflowCompleted, entry_fields
from mcp_saga.schemas.keys import Keys, PartitionUnbound
from mcp_saga.schemas.timeline import TimelineEntry
from processes import free_port, saga_process, start_http_servers, stop, stop_all, wait_for, wait_until_accepting

import mcp_saga

PARTITIONS = 3
K = Keys("saga", PARTITIONS)
ORDER = [
    ("inventory", "reserve_inventory", {"sku": "WIDGET-1", "quantity": 1}),
    ("payments", "charge_payment", {"orderId": "o", "amount": 5}),
    ("shipping", "create_shipment", {"orderId": "o", "address": "1 Main St"}),
]
FAILING = ("shipping", "create_shipment", {"orderId": "o", "address": "x", "simulateFailure": True})
UNDONE_BY = {"reserve_inventory": "release_inventory", "charge_payment": "refund_payment"}


def ids(prefix: str, per_partition: int) -> list[str]:
    """Workflow ids, `per_partition` of them in each partition (by the routing rule)."""
    found: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    n = 0
    while any(len(v) < per_partition for v in found.values()):
        wf = f"{prefix}-{n}"
        if len(found[K.partition_of(wf)]) < per_partition:
            found[K.partition_of(wf)].append(wf)
        n += 1
    return [wf for part in found.values() for wf in part]


def test_one_partition_keeps_todays_key_names() -> None:
    keys = Keys()
    assert (keys.events, keys.dead_letter, keys.outcomes) == ("saga:events", "saga:dead-letter", "saga:outcomes")
    assert (keys.index("running"), keys.deadlines) == ("saga:index:{idx}:running", "saga:index:{idx}:deadlines")
    assert keys.route("order-42") == keys.on(0) and keys.route("order-42").events == "saga:events"
    with pytest.raises(PartitionUnbound):
        _ = K.events  # with several partitions a stream name needs its partition


def test_the_routing_rule_is_cluster_keyslot_mod_partitions(redis_cluster: Any) -> None:
    """What any publisher computes is what the cluster itself says, and each partition sits in one slot."""
    client = redis_cluster.client()
    try:
        for wf in ["order-42", "a", "wf:1@x.y", "Z" * 200, *ids("r", 2)]:
            slot = client.cluster_keyslot(wf)  # CLUSTER KEYSLOT
            assert K.partition_of(wf) == slot % PARTITIONS
            assert {client.cluster_keyslot(k) for k in K.workflow_keys(wf)} == {slot}
        owners = set()
        for part in K.every():
            names = [part.events, part.outcomes, part.dead_letter, *part.index_keys()]
            assert len({client.cluster_keyslot(name) for name in names}) == 1, names  # one slot: one script
            owners.add(client.get_node_from_key(part.events).name)
        assert len(owners) == PARTITIONS  # {part-0..2}: one partition per primary of a 3-primary cluster
    finally:
        client.close()


def saga(capsys: pytest.CaptureFixture[str], config: Path, url: str, *args: str) -> Any:
    """Run a `saga` command in-process and return its JSON output."""
    capsys.readouterr()
    assert main([*args, "--redis", url, "--config", str(config), "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if args[0] != "watch" else [json.loads(line) for line in out.splitlines()]


async def run_sdk(url: str, config: Any, urls: dict[str, str], failing: list[str], clean: list[str]) -> None:
    async with Client(urls["inventory"]) as inv, Client(urls["payments"]) as pay, Client(urls["shipping"]) as ship:
        servers = {"inventory": inv, "payments": pay, "shipping": ship}

        async def one(wf: str, fail: bool) -> None:
            try:
                async with mcp_saga.workflow(wf, redis=url, servers=servers, config=config) as flow:
                    for call in ORDER:
                        await flow.call(*call)
                    if fail:
                        await flow.call(*FAILING)
            except mcp_saga.ToolCallFailed:
                assert fail

        await asyncio.gather(*(one(wf, True) for wf in failing), *(one(wf, False) for wf in clean))


async def run_gateway(base: str, workflows: list[str]) -> None:
    async with Client(f"{base}/mcp/inventory") as inv, Client(f"{base}/mcp/payments") as pay:
        for wf in workflows:
            meta = {WORKFLOW_META_KEY: wf}
            await inv.call_tool("reserve_inventory", {"sku": "WIDGET-1", "quantity": 1}, meta=meta)
            await pay.call_tool("charge_payment", {"orderId": wf, "amount": 3}, meta=meta)
            await pay.call_tool("saga_fail", {"reason": "the agent gave up"}, meta=meta)


def undone_order(client: Any, wf: str) -> list[str]:
    entries = [TimelineEntry.from_fields(f, i) for i, f in client.xrange(K.log(wf))]
    return [e.step for e in entries if e.type == "compensation-succeeded"]


def test_coordinators_workers_sdk_and_gateway_unwind_every_partition(
    redis_cluster: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = redis_cluster
    setup.flush()
    dbs = {name: tmp_path / f"{name}.db" for name in SERVERS}
    failing, clean, through_gateway = ids("fail", 2), ids("ok", 1), ids("gw", 1)
    with start_http_servers(*[(f"mcp_saga.examples.{n}", "--db", str(dbs[n])) for n in SERVERS]) as started:
        urls = {name: url for name, (_, url) in zip(SERVERS, started, strict=True)}
        port = free_port()
        config = parse_config(
            {
                "servers": {name: {"url": url, "timeout": 10} for name, url in urls.items()},
                "coordinator": {"block_ms": 50},
                "worker": {"backoff_base": 0, "jitter": 0, "concurrency": 2},
                "gateway": {"port": port, "tools": True, "allow_anonymous": True},
                # WAIT-based durability on the cluster: every event and commit confirmed by its replica.
                "redis": setup.redis_settings(PARTITIONS, wait_replicas=1),
            }
        )
        path = write_config(config, tmp_path / "saga.toml")
        logs = {name: tmp_path / f"{name}.log" for name in ("coord-a", "coord-b", "worker", "gateway")}
        procs = [
            saga_process("coordinator", "--name", "coord-a", redis_url=setup.url, config=path, log=logs["coord-a"]),
            saga_process(  # pinned to one partition: `saga stats` shows who reads which
                "coordinator",
                "--name",
                "coord-b",
                "--partition",
                "1",
                redis_url=setup.url,
                config=path,
                log=logs["coord-b"],
            ),
            saga_process("worker", redis_url=setup.url, config=path, log=logs["worker"]),
            saga_process("gateway", redis_url=setup.url, config=path, log=logs["gateway"]),
        ]
        client = setup.client()
        try:
            wait_until_accepting("127.0.0.1", port, procs[3])
            asyncio.run(run_sdk(setup.url, config, urls, failing, clean))
            asyncio.run(run_gateway(f"http://127.0.0.1:{port}", through_gateway))

            def statuses() -> dict[str, str | None]:
                return {wf: (client.hget(K.state(wf), "status") or b"").decode() or None for wf in all_ids}

            all_ids = failing + clean + through_gateway
            want = {**{wf: "compensated" for wf in failing + through_gateway}, **{wf: "completed" for wf in clean}}
            wait_for(lambda: statuses() == want, timeout=90, what=f"every workflow settled: {statuses()}")

            for wf in failing:  # LIFO: the last step first
                assert undone_order(client, wf) == ["3-create_shipment", "2-charge_payment", "1-reserve_inventory"]
            for wf in through_gateway:
                steps = [msgspec.json.decode(s)["step"] for s in client.lrange(K.steps(wf), 0, -1)]
                assert undone_order(client, wf) == steps[::-1] and len(steps) == 2
            refunds = [e for e in read_state(dbs["payments"])["effects"] if e["tool"] == "refund_payment"]
            assert len(refunds) == len(failing) + len(through_gateway)  # each undone once

            stats = saga(capsys, path, setup.url, "stats")
            assert stats["cluster"] is True
            assert stats["workflows"]["compensated"] == len(failing) + len(through_gateway)
            assert stats["workflows"]["completed"] == len(clean)
            for part in stats["partitions"]:  # every partition used; coord-a reads all, coord-b only 1
                assert part["outcomes"] > 0 and part["node"]
                readers = ["coord-a", "coord-b"] if part["partition"] == 1 else ["coord-a"]
                assert sorted(c["name"] for c in part["coordinators"]) == readers
            assert [p["stream"] for p in stats["partitions"]] == [k.events for k in K.every()]

            assert main(["stats", "--redis", setup.url, "--config", str(path)]) == 0  # the table, too
            table = capsys.readouterr().out
            assert all(k.events in table for k in K.every()) and "coord-a" in table

            listed = saga(capsys, path, setup.url, "list", "--limit", "100")
            assert {row["workflow"]: row["status"] for row in listed} == want

            where = saga(capsys, path, setup.url, "inspect", failing[0])["where"]
            slot = client.cluster_keyslot(failing[0])
            assert (where["slot"], where["partition"]) == (slot, slot % PARTITIONS)
            assert where["node"] == client.get_node_from_key(K.state(failing[0])).name
            assert where["node"].endswith(f":{setup.primary_of(K.state(failing[0])).port}")

            total = sum(client.xlen(k.outcomes) for k in K.every())
            watched = saga(capsys, path, setup.url, "watch", "--from-start", "--count", str(total))
            assert len(watched) == total
            assert {o["workflow"] for o in watched if o["type"] == "workflow-compensated"} == set(
                failing + through_gateway
            )

            # Dead letters of two partitions: a broken entry, and an event on another partition's stream.
            client.xadd(K.on(1).events, {"type": "bogus", "workflow": "x", "data": "{}"})
            stray = next(wf for wf in ids("stray", 1) if K.partition_of(wf) == 0)
            client.xadd(K.on(2).events, entry_fields(stray, WorkflowCompleted()))
            wait_for(lambda: len(saga(capsys, path, setup.url, "dead-letters")) == 2, timeout=30, what="2 dead letters")
            letters = {d["fields"]["workflow"]: d["reason"] for d in saga(capsys, path, setup.url, "dead-letters")}
            assert letters["x"] == "unknown event type 'bogus'"
            assert K.on(0).events in letters[stray] and "CLUSTER KEYSLOT" in letters[stray]
            assert client.exists(K.state(stray)) == 0  # not folded by the wrong partition's coordinator
        finally:
            client.close()
            stop_all(*procs)


def test_a_coordinator_configured_with_another_partition_count_refuses_to_start(
    redis_cluster: Any, tmp_path: Path
) -> None:
    setup = redis_cluster
    setup.flush()
    with setup.client() as client:
        client.set(K.layout, PARTITIONS)  # what the first coordinator of a 3-partition deployment records
    config = write_config(parse_config({"redis": setup.redis_settings(2)}), tmp_path / "saga.toml")
    proc = saga_process("coordinator", redis_url=setup.url, config=config, log=tmp_path / "c.log")
    try:
        assert proc.wait(60) == 2
    finally:
        stop(proc)
    text = (tmp_path / "c.log").read_text()
    assert "written with 3 partition(s)" in text and "[redis] partitions = 2" in text


def test_the_partition_count_is_recorded_and_a_one_partition_deployment_is_recognised() -> None:
    import fakeredis
    from mcp_saga.runtime.connect import check_layout
    from mcp_saga.runtime.redis_checks import RedisSetupError

    r = fakeredis.FakeRedis()
    check_layout(r, Keys())
    assert r.get(K.layout) is None  # one partition writes nothing: it starts on a Redis out of memory too
    r.xadd(Keys().events, {"type": "workflow-completed", "workflow": "w", "data": "{}"})
    with pytest.raises(RedisSetupError, match="written with 1 partition"):
        check_layout(r, K)  # today's stream holds events: switching to 3 is a migration
    r.flushall()
    check_layout(r, K)
    assert r.get(K.layout) == b"3"
    check_layout(r, K)
    with pytest.raises(RedisSetupError, match=r"written with 3 partition\(s\).*partitions = 1"):
        check_layout(r, Keys())


# WAIT-based durability (`[redis] wait_replicas`) -------------------------------------------------


def on_replica(client: Any, key: str) -> redis.Redis:
    """A connection to the replica of `key`'s primary that may read its slots (READONLY)."""
    linked = client.get_node_from_key(key).redis_connection.info("replication")["slave0"]  # the primary says
    replica = redis.Redis(host=linked["ip"], port=linked["port"], single_connection_client=True)
    replica.execute_command("READONLY")
    return replica


def test_with_wait_each_event_is_on_the_replica_when_it_is_acknowledged(redis_cluster: Any) -> None:
    """Sync and asyncio publishers on a cluster: an acknowledged event is already on its replica.

    Replication on loopback is fast but asynchronous; reading the replica right after each
    acknowledgement, with no wait, checks that the WAIT ran on the connection that wrote.
    """
    setup = redis_cluster
    setup.flush()
    durability = Durability(replicas=1, timeout_ms=2000)
    workflows = ids("durable", 3)
    with contextlib.closing(setup.client()) as client:
        publisher = Publisher(client, "saga", PARTITIONS, durability=durability)
        replicas = {wf: on_replica(client, publisher.stream_for(wf)) for wf in workflows}
        try:
            for wf in workflows:
                entry_id = publisher.publish(wf, WorkflowCompleted())
                assert replicas[wf].xrange(publisher.stream_for(wf), entry_id, entry_id), wf

            async def publish_async() -> list[tuple[str, str]]:
                client = redis.asyncio.RedisCluster.from_url(setup.url)
                publisher = AsyncPublisher(client, "saga", PARTITIONS, durability=durability)
                try:
                    return [(wf, await publisher.publish(wf, WorkflowCompleted())) for wf in workflows]
                finally:
                    await client.aclose()
                    for node in publisher._nodes.values():
                        await node.aclose()

            for wf, entry_id in asyncio.run(publish_async()):
                stream = publisher.stream_for(wf)
                assert replicas[wf].xrange(stream, entry_id, entry_id), wf
        finally:
            for replica in replicas.values():
                replica.close()


def test_a_wait_counts_the_replicas_of_the_node_that_wrote(redis_cluster: Any, monkeypatch: Any) -> None:
    """Each primary here has one replica: asking for two is refused as not acknowledged (NOREPLICAS)."""
    monkeypatch.setattr(publish, "NOT_REPLICATED_RETRY_FOR", 0.0)  # one re-send, then the error
    setup = redis_cluster
    setup.flush()
    with contextlib.closing(setup.client()) as client:
        publisher = Publisher(client, "saga", PARTITIONS, durability=Durability(replicas=2, timeout_ms=50))
        with pytest.raises(NotReplicated, match="confirmed by 1 of 2"):
            publisher.publish("durable-x", WorkflowCompleted())


def test_a_durable_batch_across_primaries_replies_in_order_each_write_on_its_replica(redis_cluster: Any) -> None:
    """The coordinator's commit path (`Writes`): scripts of workflows on every primary in one batch."""
    setup = redis_cluster
    setup.flush()
    workflows = ids("batch", 2)
    with contextlib.closing(setup.client()) as client:
        writes = Writes(client, Durability(replicas=1, timeout_ms=2000))
        script = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
        for n, wf in enumerate(workflows):
            key = K.state(wf)
            evaluate(writes.pipe(key), script, [key], [n + 1])
        assert writes.execute("batch") == [n + 1 for n in range(len(workflows))]
        assert len({client.get_node_from_key(K.state(wf)).name for wf in workflows}) == PARTITIONS
        for n, wf in enumerate(workflows):
            replica = on_replica(client, K.state(wf))
            try:
                assert replica.get(K.state(wf)) == str(n + 1).encode()
            finally:
                replica.close()
