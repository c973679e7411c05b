"""Partitions on one standalone Redis: the same code as on a cluster, fast enough to check in detail.

Three in-process coordinators, one per partition, fold what the SDK's publisher routed; the
readers (`saga stats`, `list`, `dead-letters`, operator commands) gather across partitions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp_saga.cli.main import main
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.runtime.publish import Publisher
from mcp_saga.runtime.reader import Reader
from mcp_saga.schemas.config import parse_config, write_config
from mcp_saga.schemas.events import StepCompleted, entry_fields
from mcp_saga.schemas.keys import Keys, key_slot

K = Keys("saga", 3)
REFUND = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "refund_payment", "parameters": {"tx": "$response.body#/tx"}},
}


def charge(n: int) -> StepCompleted:
    return StepCompleted(
        step=f"charge-{n}",
        server="payments",
        tool="charge_payment",
        result={"structuredContent": {"tx": f"T-{n}"}},
        recovery=REFUND,
    )


@pytest.fixture
def setup(r: redis.Redis, redis_url: str, tmp_path: Path) -> tuple[list[Coordinator], Path]:
    config = parse_config({"coordinator": {"block_ms": 10}, "redis": {"partitions": 3}})
    coordinators = [Coordinator(r, config, name="c", partition=p) for p in range(3)]
    for coordinator in coordinators:
        coordinator.ensure_group()
    return coordinators, write_config(config, tmp_path / "saga.toml")


def pump(coordinators: list[Coordinator]) -> None:
    while sum(c.step().events for c in coordinators):
        pass


def saga(capsys: pytest.CaptureFixture[str], url: str, config: Path, *args: str) -> Any:
    capsys.readouterr()
    assert main([*args, "--redis", url, "--config", str(config), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_publishers_route_and_each_partitions_coordinator_folds_its_own(
    r: redis.Redis, redis_url: str, setup: tuple[list[Coordinator], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    coordinators, config = setup
    publisher = Publisher(r, "saga", 3)
    workflows = [f"order-{n}" for n in range(12)]
    for wf in workflows:
        entry = publisher.step_completed(wf, "charge-1", "payments", "charge_payment", {}, charge(1).result, REFUND)
        assert r.xrange(K.route(wf).events, entry, entry)  # on its partition's stream, nowhere else
    for wf in workflows[:6]:
        publisher.workflow_failed(wf, "shipping failed", steps_completed=1)
    for wf in workflows[6:]:
        publisher.workflow_completed(wf)
    assert all(r.xlen(part.events) for part in K.every())  # every partition got some
    pump(coordinators)

    reader = Reader(r, K)
    counts = reader.counts()
    assert (counts["compensating"], counts["completed"]) == (6, 6)
    for wf in workflows:  # indexed in its own partition only
        owner = K.partition_of(wf)
        for part in K.every():
            indexed = any(r.zscore(part.index(s), wf) is not None for s in ("compensating", "completed"))
            assert indexed == (part.part == owner), (wf, part.part)
    assert {wf for wf, _ in reader.recent(limit=50)} == set(workflows)
    assert {wf for wf, _ in reader.search("order-1")} == {"order-1", "order-10", "order-11"}

    # An operator command joins its workflow's partition, and that partition's coordinator applies it.
    target = workflows[0]
    capsys.readouterr()
    assert main(["resolve", target, "--step", "charge-1", "--note", "refunded by hand", "--redis", redis_url,
                 "--config", str(config)]) == 0  # fmt: skip
    assert K.route(target).events in capsys.readouterr().out
    pump(coordinators)
    assert r.hget(K.state(target), "status") in (b"compensated", b"needs-attention")

    stats = saga(capsys, redis_url, config, "stats")
    assert [p["partition"] for p in stats["partitions"]] == [0, 1, 2]
    assert all(p["coordinators"] == [{"name": "c", "pending": 0, "idle_ms": p["coordinators"][0]["idle_ms"]}]
               for p in stats["partitions"])  # fmt: skip
    assert stats["workflows"]["completed"] == 6
    assert {g["stream"] for g in stats["events"]["groups"]} == {k.events for k in K.every()}


def test_dead_letters_gather_across_partitions_and_a_misrouted_event_names_its_stream(
    r: redis.Redis, redis_url: str, setup: tuple[list[Coordinator], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    coordinators, config = setup
    stray = next(f"stray-{n}" for n in range(100) if K.partition_of(f"stray-{n}") == 1)
    r.xadd(K.on(0).events, entry_fields(stray, charge(1)))  # partition 1's workflow, on partition 0's stream
    r.xadd(K.on(2).events, {"type": "bogus", "workflow": "w", "data": "{}"})
    pump(coordinators)
    letters = saga(capsys, redis_url, config, "dead-letters")
    reasons = {d["fields"]["workflow"]: d["reason"] for d in letters}
    assert reasons["w"] == "unknown event type 'bogus'"
    assert reasons[stray].startswith(f"published to {K.on(0).events}, but workflow '{stray}' belongs to partition 1")
    assert K.on(1).events in reasons[stray]
    assert r.exists(K.state(stray)) == 0 and r.xlen(K.on(0).dead_letter) == 1 and r.xlen(K.on(2).dead_letter) == 1


def test_saga_partition_computes_the_route_from_the_config_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(parse_config({"redis": {"partitions": 3}}), tmp_path / "saga.toml")
    capsys.readouterr()
    assert main(["partition", "order-42", "--config", str(config), "--json"]) == 0  # no Redis needed
    found = json.loads(capsys.readouterr().out)
    assert (found["slot"], found["partition"]) == (key_slot("order-42"), key_slot("order-42") % 3) == (9984, 0)
    assert found["events"] == "saga:events:{part-0}" and found["keys"][0] == "saga:{order-42}:state"
    assert main(["partition", "bad id!", "--config", str(config)]) == 2


def test_a_coordinator_pinned_to_a_partition_outside_the_config_is_refused(r: redis.Redis) -> None:
    from mcp_saga.coordinator.partitions import run_partitions
    from mcp_saga.schemas.config import ConfigError

    with pytest.raises(ConfigError, match=r"--partition \[5\]: the config has 3 partition\(s\), 0..2"):
        run_partitions(r, parse_config({"redis": {"partitions": 3}}), "c", only=[5])
