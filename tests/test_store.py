"""The coordinator's store against a real redis-server: what its hand-packed commands say."""

from __future__ import annotations

import time

import redis
from mcp_saga.coordinator import store as store_module
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.coordinator.machine import Machine, WorkflowView
from mcp_saga.coordinator.store import Store, _read_entries
from mcp_saga.runtime.packing import pack
from mcp_saga.schemas.config import parse_config
from mcp_saga.schemas.events import (
    CompensationSucceeded,
    StepCompleted,
    StepStarted,
    WorkflowFailed,
    entry_fields,
)
from mcp_saga.schemas.records import forward_key, state_from_hash
from redis.connection import Connection

CONFIG = parse_config({})
RECOVERY = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$response.body#/id"}},
}


def planned(workflow: str, names: list[str], base: int = 0) -> tuple[int, list]:
    """A workflow's steps as the coordinator's fast path plans them (some with timeline entries)."""
    machine, now, steps = Machine(CONFIG), time.time(), []
    for n, name in enumerate(names):
        if name.startswith("intent-"):
            data = StepStarted(step=name, server="svc", tool="do", forward_key=forward_key(workflow, name))
            comp, entries = machine.plan_started(workflow, data, base + n, now, f"1-{n}", ("a repair",))
        else:
            recovery = None if name.startswith("plain-") else RECOVERY  # no recovery: a timeline entry
            data = StepCompleted(
                step=name, server="svc", tool="do", result={"structuredContent": {"id": name}}, recovery=recovery
            )
            comp, entries = machine.plan_step(workflow, data, base + n, False, now, f"1-{n}")
        steps.append((comp, f'{{"step":"{name}"}}'.encode(), entries))
    return base, steps


def test_the_hand_packed_record_is_the_command_redis_py_would_send(r: redis.Redis) -> None:
    store = Store(r, CONFIG.keys(), CONFIG.coordinator)
    batches = {
        "order-1": planned("order-1", ["a"]),
        "order-2": planned("order-2", ["b", "plain-c", "intent-d"], base=4),
        "ordér-3": planned("ordér-3", ["plain-e"]),
    }
    now = 1_700_000_000.25
    deadlines = {"order-1": "1700000060.250000"}  # an intent's watchdog deadline: out of the one-step format
    ((workflows, keys, args),) = store._record_calls(batches, now, deadlines)
    assert workflows == list(batches)
    assert keys[: len(CONFIG.keys().index_keys())] == CONFIG.keys().index_keys()  # one Redis: indexed here
    expected = b"".join(Connection().pack_command("EVALSHA", store._record_steps.sha, len(keys), *keys, *args))
    assert store._packed_record(batches, now, deadlines) == expected
    assert store._packed_record(batches, now, deadlines) == expected  # and again, from the packed keys it kept


def test_the_read_and_trail_record_ahead_packs_are_the_commands_redis_py_would_send(r: redis.Redis) -> None:
    """record_ahead packs its read and its trail with hiredis directly: the bytes must be redis-py's."""
    store = Store(r, CONFIG.keys(), CONFIG.coordinator)
    keys = CONFIG.keys()
    coord = Coordinator(r, CONFIG, name="coord-ü")
    view = WorkflowView("ordér-1", state_from_hash({}), {}, True, outbox=[b'[{"id":"x/1"}]'])
    commands = [
        ("XREADGROUP", "GROUP", keys.group, coord.name, "COUNT", CONFIG.coordinator.batch, "STREAMS", keys.events, ">"),
        *store.settle_commands([view], [b"1700000000000-%d" % n for n in range(100)]),
    ]
    for command in commands:
        assert pack(command) == b"".join(Connection().pack_command(*command))


def test_recorded_ahead_the_steps_are_written_and_the_reply_read(r: redis.Redis) -> None:
    store = Store(r, CONFIG.keys(), CONFIG.coordinator)
    keys = CONFIG.keys()
    r.xgroup_create(keys.events, keys.group, id="0", mkstream=True)
    r.xadd(keys.events, {"type": "workflow-completed", "workflow": "order-9", "data": "{}"})
    r.script_load(store._record_steps.text)
    batches = {"order-1": planned("order-1", ["a", "plain-b"]), "order-2": planned("order-2", ["c"], base=3)}
    read = ("XREADGROUP", "GROUP", keys.group, "me", "COUNT", 10, "STREAMS", keys.events, ">")
    _, flight = store.record_ahead(None, batches, time.time(), [read, ("PING",)])
    outcomes = store.collect(flight)
    (entries, pong) = store.read_trail(flight)
    # order-2 expected 3 steps already recorded, and has none: nothing written, the CAS path decides
    assert outcomes["order-2"] is None and not r.exists(keys.state("order-2"))
    first = outcomes["order-1"]
    assert first is not None and (first.created, first.steps, first.version) == (True, 2, 1)
    state = state_from_hash(r.hgetall(keys.state("order-1")))
    assert (state.status, state.steps, state.created_at) == ("running", 2, first.created_at)
    assert r.lrange(keys.steps("order-1"), 0, -1) == [b'{"step":"a"}', b'{"step":"plain-b"}']
    assert set(r.hkeys(keys.comp("order-1"))) == {b"a", b"plain-b"}
    assert [e[b"plan"] for _, e in r.xrange(keys.log("order-1"))] == [b"skipped"]  # plain-b's timeline entry
    assert entries[0][1][0][1][b"workflow"] == b"order-9" and pong is True


def test_raw_stream_replies_read_as_redis_py_parses_them(r: redis.Redis) -> None:
    r.xgroup_create("s", "a", id="0", mkstream=True)
    r.xgroup_create("s", "b", id="0")
    ids = [r.xadd("s", {"n": str(n), "k": "v"}) for n in range(3)]
    connection = r.connection_pool.get_connection()
    try:

        def raw(group: str, start: str) -> object:
            connection.send_command("XREADGROUP", "GROUP", group, "me", "COUNT", 10, "STREAMS", "s", start)
            return connection.read_response()

        assert _read_entries(raw("a", ">")) == r.xreadgroup("b", "me", {"s": ">"}, count=10)
        r.xdel("s", ids[0])  # a pending entry deleted: delivered again with no fields
        assert _read_entries(raw("a", "0")) == r.xreadgroup("b", "me", {"s": "0"}, count=10)
        assert _read_entries(raw("a", ">")) == r.xreadgroup("b", "me", {"s": ">"}, count=10) == []
    finally:
        r.connection_pool.release(connection)


def test_a_commit_packed_by_hiredis_is_what_redis_py_would_send(r: redis.Redis, monkeypatch) -> None:
    """On one Redis the commit's commands (a failure's script with its index item, the job it carries;
    the reports' script with its outcomes) are packed by hiredis: byte for byte redis-py's packing,
    which encodes floats and ints its own way."""
    sent: list[tuple] = []

    def packing(args: tuple) -> bytes:
        sent.append(args)
        return pack(args)

    monkeypatch.setattr(store_module, "pack", packing)
    coord = Coordinator(r, CONFIG, name="packed")
    coord.ensure_group()
    keys = CONFIG.keys()
    step = StepCompleted(
        step="a", server="svc", tool="do", result={"structuredContent": {"id": "x"}}, recovery=RECOVERY
    )
    r.xadd(keys.events, entry_fields("wf-p", step))
    r.xadd(keys.events, entry_fields("wf-p", WorkflowFailed(reason="ünïcode 1.5")))
    coord.process(coord._read(">"), redelivered=False)
    r.xadd(keys.events, entry_fields("wf-p", CompensationSucceeded(step="a", dispatch=1)))
    coord.process(coord._read(">"), redelivered=False)
    scripts = [args for args in sent if args[0] == "EVALSHA"]
    assert len(scripts) >= 3, sent  # the failure's commit, the job it carried, the reports' commit
    for args in sent:
        assert pack(args) == b"".join(Connection().pack_command(*args)), args
    assert state_from_hash(r.hgetall(keys.state("wf-p"))).status == "compensated"
    assert r.zscore(keys.index("compensated"), "wf-p") is not None  # indexed by the commit itself
    assert [f[b"type"] for _, f in r.xrange(keys.outcomes)][-1] == b"workflow-compensated"
