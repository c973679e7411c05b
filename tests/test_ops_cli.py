"""The ops CLI against a real Redis, with workflow state made by the real coordinator in-process.

Operator commands are checked end to end: the CLI validates and publishes, the coordinator applies
what it published, and the records and timeline show the effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from mcp_saga.cli.main import main
from mcp_saga.coordinator.consumer import Coordinator
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import Config, parse_config, write_config
from mcp_saga.schemas.events import (
    CompensationFailed,
    CompensationRefused,
    CompensationSucceeded,
    FailedStep,
    OperatorSkip,
    Payload,
    StepCompleted,
    WorkflowCompleted,
    WorkflowFailed,
    entry_fields,
)
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.records import Compensation, comp_decoder
from processes import REPO

Run = Callable[..., tuple[int, str, str]]

KEYS = Keys()
RELEASE = {
    "strategy": "compensation",
    "compensatingOperation": {
        "operationId": "release_inventory",
        "parameters": {"reservationId": "$response.body#/reservationId"},
    },
}
REFUND = {
    "strategy": "compensation",
    "compensatingOperation": {"operationId": "refund_payment", "parameters": {"tx": "$response.body#/tx"}},
}


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SAGA_CONFIG", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)


@pytest.fixture
def config() -> Config:
    return parse_config({"coordinator": {"block_ms": 10}})


@pytest.fixture
def coord(r: redis.Redis, config: Config) -> Coordinator:
    coordinator = Coordinator(r, config, name="test")
    coordinator.ensure_group()
    return coordinator


def publish(r: redis.Redis, workflow: str, *payloads: Payload) -> None:
    for payload in payloads:
        r.xadd(KEYS.events, entry_fields(workflow, payload))


def pump(coord: Coordinator) -> None:
    """Run the coordinator until it has read everything published so far."""
    while coord.step().events:
        pass


def reserve() -> StepCompleted:
    return StepCompleted(
        step="reserve",
        server="inventory",
        tool="reserve_inventory",
        arguments={"sku": "A-1"},
        result={"structuredContent": {"reservationId": "R-1"}},
        recovery=RELEASE,
    )


def charge() -> StepCompleted:
    return StepCompleted(
        step="charge",
        server="payments",
        tool="charge_payment",
        result={"structuredContent": {"tx": "T-1"}},
        recovery=REFUND,
    )


def failed(steps: int = 2) -> WorkflowFailed:
    return WorkflowFailed(
        reason="shipping failed",
        failed_step=FailedStep(tool="create_shipment", error="no carrier"),
        steps_completed=steps,
    )


@pytest.fixture
def stuck(r: redis.Redis, coord: Coordinator) -> str:
    """order-1: reserve and charge recorded, the workflow failed, refunding the charge failed for good."""
    publish(r, "order-1", reserve(), charge(), failed())
    pump(coord)
    assert comp(r, "order-1", "charge").dispatch == 1
    publish(r, "order-1", CompensationFailed(step="charge", dispatch=1, attempt=1, error="card processor down"))
    pump(coord)
    assert r.hget(KEYS.state("order-1"), "status") == b"needs-attention"
    return "order-1"


def comp(r: redis.Redis, workflow: str, step: str) -> Compensation:
    return comp_decoder.decode(r.hget(KEYS.comp(workflow), step))


def timeline(r: redis.Redis, workflow: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(KEYS.log(workflow))]


def last_event(r: redis.Redis) -> tuple[str, dict]:
    [(_, fields)] = r.xrevrange(KEYS.events, count=1)
    return fields[b"type"].decode(), json.loads(fields[b"data"])


@pytest.fixture
def saga(redis_url: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run `saga ARGS --redis URL` in-process: (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--redis", redis_url])
        out, err = capsys.readouterr()
        return code, out, err

    return run


# Reading -------------------------------------------------------------------------------------


def test_inspect_shows_state_steps_compensations_and_timeline(r: redis.Redis, stuck: str, saga: Run) -> None:
    code, out, _ = saga("inspect", stuck)
    assert code == 0
    key = comp(r, stuck, "charge").idempotency_key
    for expected in (
        "needs-attention",
        "shipping failed",
        "create_shipment",
        '{"reservationId":"R-1"}',  # the short result of the step
        "refund_payment",
        "release_inventory",
        key,
        "card processor down",
        "workflow-failed",
        "compensation-dispatched",
        "compensation-failed",
    ):
        assert expected in out, expected


def test_inspect_shows_an_in_doubt_step_as_announced_without_an_answer(
    r: redis.Redis, coord: Coordinator, saga: Run
) -> None:
    """A call announced (step-started) whose answer never came: the stack says so, and the record is flagged."""
    from mcp_saga.runtime.publish import started_entry

    intent = started_entry("order-11", "reserve", "inventory", "reserve_inventory", {}, RELEASE)
    assert intent is not None
    r.xadd(KEYS.events, intent)
    publish(r, "order-11", WorkflowFailed(reason="the reservation timed out", steps_completed=0))
    pump(coord)
    code, out, _ = saga("inspect", "order-11")
    assert code == 0
    for expected in ("in the order the calls started", "no answer recorded (announced)", "in-doubt", "in doubt recall"):
        assert expected in out, (expected, out)


def test_inspect_json_is_complete(r: redis.Redis, stuck: str, saga: Run) -> None:
    code, out, _ = saga("inspect", stuck, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["workflow"] == stuck
    assert data["state"]["status"] == "needs-attention"
    assert data["state"]["expectedSteps"] == 2
    assert [s["step"] for s in data["steps"]] == ["reserve", "charge"]
    assert data["steps"][0]["arguments"] == {"sku": "A-1"}
    records = {c["step"]: c for c in data["compensations"]}
    assert records["charge"]["status"] == "failed"
    assert records["charge"]["lastError"] == "card processor down"
    assert records["reserve"]["status"] == "pending"
    assert records["reserve"]["operationId"] == "release_inventory"
    types = [e["type"] for e in data["timeline"]]
    assert types[0] == "workflow-failed"  # compensable steps are on the stack, not the timeline
    assert "compensation-failed" in types
    assert all(e["id"] and e["at"] for e in data["timeline"])
    # Typed on the way in and out, the timeline still shows exactly what the stream holds.
    raw = [{"id": i.decode(), **{k.decode(): v.decode() for k, v in f.items()}} for i, f in r.xrange(KEYS.log(stuck))]
    assert data["timeline"] == raw

    _, out, _ = saga("inspect", stuck, "--json", "--last", "1")
    assert [e["type"] for e in json.loads(out)["timeline"]] == [types[-1]]


def test_running_workflow_is_inspectable(r: redis.Redis, coord: Coordinator, saga: Run) -> None:
    publish(r, "order-9", reserve())
    pump(coord)
    _, out, _ = saga("inspect", "order-9", "--json")
    assert json.loads(out)["state"]["status"] == "running"  # a default value, still shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("inspect", "nope"), "saga inspect: no workflow 'nope'"),
        (("inspect", "bad id!"), "saga inspect: invalid workflow id 'bad id!'"),
        (("retry", "nope", "--step", "a"), "saga retry: no workflow 'nope'"),
    ],
)
def test_unknown_workflow_is_one_line_and_exit_2(
    r: redis.Redis, saga: Run, argv: tuple[str, ...], message: str
) -> None:
    code, out, err = saga(*argv)
    assert code == 2
    assert out == ""
    assert err.startswith(message)
    assert err.count("\n") == 1
    assert r.xlen(KEYS.events) == 0


def test_list_by_status(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    publish(r, "order-2", reserve(), WorkflowCompleted())
    publish(r, "order-3", reserve())
    pump(coord)

    code, out, _ = saga("list", "--json")
    assert code == 0
    rows = {w["workflow"]: w for w in json.loads(out)}
    assert {w: v["status"] for w, v in rows.items()} == {
        "order-1": "needs-attention",
        "order-2": "completed",
        "order-3": "running",
    }
    assert rows["order-1"]["steps"] == 2
    assert "card processor down" in rows["order-1"]["attention"]

    _, out, _ = saga("list", "--status", "completed", "--json")
    assert [w["workflow"] for w in json.loads(out)] == ["order-2"]
    _, out, _ = saga("list", "--limit", "1", "--json")
    assert len(json.loads(out)) == 1

    code, out, _ = saga("list", "--status", "needs-attention")
    assert code == 0
    assert "order-1" in out and "order-2" not in out


def test_wrong_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["list", "--status", "bogus"],
        ["list", "--limit", "0"],
        ["resolve", "order-1", "--step", "charge"],  # --note is required
        ["approve", "order-1"],  # --step is required
        ["retry", "order-1", "--wait", "soon"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        assert "saga " in capsys.readouterr().err


def test_unreachable_redis_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--redis", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("saga stats: cannot reach Redis") and err.count("\n") == 1


def test_watch_prints_outcomes(stuck: str, saga: Run) -> None:
    code, out, _ = saga("watch", "--from-start", "--count", "2")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 2
    assert "compensation-failed" in lines[0] and "order-1" in lines[0] and "step=charge" in lines[0]
    assert "workflow-needs-attention" in lines[1]

    _, out, _ = saga("watch", "--from-start", "--count", "1", "--json")
    outcome = json.loads(out)
    assert outcome["type"] == "compensation-failed" and outcome["workflow"] == stuck and outcome["id"]


# Acting ---------------------------------------------------------------------------------------


def test_retry_sends_the_event_and_the_coordinator_redispatches(
    r: redis.Redis, coord: Coordinator, stuck: str, saga
) -> None:
    code, out, _ = saga("retry", stuck, "--step", "charge", "--by", "alice", "--note", "processor is back")
    assert code == 0
    assert "sent operator-retry for order-1 step charge by alice" in out
    kind, data = last_event(r)
    assert (kind, data) == ("operator-retry", {"step": "charge", "by": "alice", "note": "processor is back"})

    pump(coord)
    record = comp(r, stuck, "charge")
    assert (record.status, record.dispatch) == ("queued", 2)
    assert r.hget(KEYS.state(stuck), "status") == b"compensating"
    entry = next(e for e in timeline(r, stuck) if e["type"] == "operator-retry")
    assert (entry["step"], entry["by"], entry["note"]) == ("charge", "alice", "processor is back")


def test_retry_without_step_names_what_it_retries(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    code, out, _ = saga("retry", stuck, "--json", "--by", "bob")
    assert code == 0
    report = json.loads(out)
    assert report["sent"] == "operator-retry" and report["step"] is None and report["steps"] == ["charge"]
    assert r.xrevrange(KEYS.events, count=1)[0][0].decode() == report["id"]
    pump(coord)
    assert comp(r, stuck, "charge").status == "queued"


def test_resolve_lets_unwinding_continue(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    code, _, _ = saga("resolve", stuck, "--step", "charge", "--note", "refunded by hand", "--by", "carol")
    assert code == 0
    assert last_event(r) == ("operator-resolve", {"step": "charge", "by": "carol", "note": "refunded by hand"})
    pump(coord)
    assert comp(r, stuck, "charge").status == "resolved"
    assert comp(r, stuck, "reserve").status == "queued"  # the next step down is being undone
    publish(r, stuck, CompensationSucceeded(step="reserve", dispatch=1))
    pump(coord)
    assert r.hget(KEYS.state(stuck), "status") == b"compensated"


def test_skip_lets_unwinding_continue(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    assert saga("skip", stuck, "--step", "charge")[0] == 0
    assert last_event(r)[0] == "operator-skip"
    pump(coord)
    assert comp(r, stuck, "charge").status == "skipped"
    assert comp(r, stuck, "reserve").status == "queued"


def test_approve_releases_a_held_compensation(r: redis.Redis, coord: Coordinator, saga: Run) -> None:
    publish(r, "order-4", reserve(), failed(1))
    pump(coord)
    publish(
        r,
        "order-4",
        CompensationRefused(step="reserve", dispatch=1, attempt=1, status="awaiting-approval", reason="policy"),
    )
    pump(coord)
    assert comp(r, "order-4", "reserve").status == "awaiting-approval"

    code, out, _ = saga("approve", "order-4", "--step", "reserve", "--by", "dave", "--note", "ok to release")
    assert code == 0 and "sent operator-approve" in out
    assert last_event(r) == ("operator-approve", {"step": "reserve", "by": "dave", "note": "ok to release"})
    pump(coord)
    record = comp(r, "order-4", "reserve")
    assert (record.status, record.approved, record.dispatch) == ("queued", True, 2)

    code, _, err = saga("approve", "order-4", "--step", "reserve")
    assert code == 2 and "already approved" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("retry", "order-1", "--step", "ship"), "workflow 'order-1' has no step 'ship' (steps: reserve, charge)"),
        (("retry", "order-1", "--step", "reserve"), "step 'reserve' is pending; retry applies to a failed"),
        (("skip", "order-1", "--step", "bad step"), "invalid step id 'bad step'"),
        (("approve", "order-1", "--step", "ghost"), "has no step 'ghost'"),
        (("retry", "order-2"), "workflow 'order-2' is running; operator commands apply only once it has failed"),
        (("retry", "order-1", "--by", "x" * 201), "name must be 1 to 200 characters"),
    ],
)
def test_pointless_commands_are_refused_with_the_reason(
    r: redis.Redis, coord: Coordinator, stuck: str, saga: Run, argv: tuple[str, ...], message: str
) -> None:
    publish(r, "order-2", reserve())
    pump(coord)
    before = r.xlen(KEYS.events)
    code, out, err = saga(*argv)
    assert out == ""
    assert code == 2
    assert err.startswith(f"saga {argv[0]}: ") and message in err and err.count("\n") == 1
    assert r.xlen(KEYS.events) == before  # nothing was sent


def test_retry_of_a_step_with_no_usable_compensation_says_what_to_do_instead(
    r: redis.Redis, coord: Coordinator, saga
) -> None:
    broken = StepCompleted(step="ship", server="shipping", tool="create_shipment", result={}, recovery=RELEASE)
    publish(r, "order-5", broken, failed(1))
    pump(coord)
    assert comp(r, "order-5", "ship").status == "unrecoverable"
    code, _, err = saga("retry", "order-5", "--step", "ship")
    assert code == 2 and "has no usable compensation to retry" in err and "resolve or skip it instead" in err


def run_while_coordinating(
    r: redis.Redis, coord: Coordinator, command: Callable[[], tuple[int, str, str]]
) -> tuple[int, str, str]:
    """Run a `--wait` command in a thread and the coordinator here, once the command has published."""
    result: list[tuple[int, str, str]] = []
    sent = r.xlen(KEYS.events)
    cli = threading.Thread(target=lambda: result.append(command()))
    cli.start()
    while cli.is_alive() and r.xlen(KEYS.events) == sent:
        time.sleep(0.01)  # the CLI is still validating; the coordinator must not move the records yet
    while cli.is_alive():
        coord.step()
    cli.join()
    [outcome] = result
    return outcome


def test_wait_reports_the_applied_status(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    code, out, err = run_while_coordinating(
        r, coord, lambda: saga("retry", stuck, "--step", "charge", "--by", "erin", "--wait", "60")
    )
    assert code == 0, err
    assert "applied: workflow order-1 is compensating; step charge is queued" in out


def test_wait_says_when_the_command_changed_nothing(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    # Another operator's skip is already on the stream when this retry is validated, so the retry
    # passes the CLI's check but finds the step skipped when the coordinator gets to it.
    publish(r, stuck, OperatorSkip(step="charge", by="someone else"))
    code, out, err = run_while_coordinating(
        r, coord, lambda: saga("retry", stuck, "--step", "charge", "--wait", "60", "--json")
    )
    report = json.loads(out)
    assert code == 1 and report["outcome"] == "unchanged" and report["stepStatus"] == {"charge": "skipped"}
    assert "changed nothing" in err


# The service ----------------------------------------------------------------------------------


def test_stats_and_dead_letters(r: redis.Redis, coord: Coordinator, stuck: str, saga: Run) -> None:
    publish(r, "order-2", reserve(), WorkflowCompleted())
    r.xadd(KEYS.events, {"type": "bogus", "workflow": "order-7", "data": "{}"})
    r.xadd(KEYS.events, {"type": "step-completed", "workflow": "order-8", "data": "not json"})
    pump(coord)

    code, out, _ = saga("stats", "--json")
    assert code == 0
    stats = json.loads(out)
    assert stats["workflows"]["needs-attention"] == 1 and stats["workflows"]["completed"] == 1
    assert stats["workflows"]["running"] == 0
    assert stats["queue"]["name"] == "saga"
    assert stats["queue"]["queued"] == 1  # the refund job nobody has run (tests start no worker)
    assert stats["deadLetters"] == 2
    assert stats["outcomes"] == r.xlen(KEYS.outcomes) > 0
    assert stats["events"]["length"] == r.xlen(KEYS.events)
    [group] = stats["events"]["groups"]
    assert (group["name"], group["consumers"], group["pending"]) == ("coordinators", 1, 0)
    assert group["lag"] in (0, None)  # Redis reports no lag (null) once entries were trimmed below the group

    code, out, _ = saga("stats")
    assert code == 0 and "needs-attention" in out and "coordinators" in out and "saga:dead-letter" in out

    code, out, _ = saga("dead-letters", "--json")
    assert code == 0
    entries = json.loads(out)
    assert [e["fields"]["workflow"] for e in entries] == ["order-8", "order-7"]  # newest first
    assert entries[1]["reason"] == "unknown event type 'bogus'"
    assert entries[0]["reason"].startswith("step-completed data:")
    assert entries[1]["originalId"] and entries[1]["at"]
    _, out, _ = saga("dead-letters", "--limit", "1", "--json")
    assert len(json.loads(out)) == 1

    code, out, _ = saga("dead-letters")
    assert code == 0 and "unknown event type 'bogus'" in out


def test_stats_on_an_empty_redis(r: redis.Redis, saga: Run) -> None:
    code, out, _ = saga("stats")
    assert code == 0 and "no coordinator has started" in out


def test_the_installed_command(redis_url: str, stuck: str) -> None:
    saga = Path(sys.executable).with_name("saga")
    env = {**os.environ, "REDIS_URL": redis_url}
    env.pop("SAGA_CONFIG", None)
    done = subprocess.run([saga, "list", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [w["workflow"] for w in json.loads(done.stdout)] == [stuck]
    done = subprocess.run([saga, "inspect", "order-404"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "saga inspect: no workflow 'order-404' (never seen by a coordinator, or expired)"


# check ----------------------------------------------------------------------------------------


def test_check_reports_problems_per_tool_and_fails_on_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trivial = {
        "command": [sys.executable, "-m", "mcp_saga.examples.trivial"],
        "cwd": str(REPO),
        "recovery": {"noop_undo": compensation("no_such_tool", n="$response.body#/n")},
    }
    config = write_config(parse_config({"servers": {"trivial": trivial}}), tmp_path / "saga.toml")
    code = main(["check", "trivial", "--config", str(config), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["tools"] == ["big", "noop", "noop_undo"]
    checked = {(c["tool"], c["source"]): c["problems"] for c in report["checked"]}
    assert checked[("noop", "server (annotations)")] == []  # the server's own declaration is sound
    [problem] = [p for p in checked[("noop_undo", "overlay")] if p["severity"] == "error"]
    assert problem["field"] == "compensatingOperation.operationId" and "no_such_tool" in problem["message"]
    assert report["errors"] == 1

    code = main(["check", "nowhere", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == "saga check: no server 'nowhere' in the config (configured: trivial)"
