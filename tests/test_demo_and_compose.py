"""`saga demo` end to end as a user runs it, and compose.yaml's commands exist."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mcp_saga.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


# Known to fail now and then on a loaded 2-core box for reasons not yet found (see the README's
# "Known flaky tests"); one rerun, and a second failure fails the suite.
@pytest.mark.flaky(reruns=1)
def test_saga_demo_shows_baseline_leftovers_and_saga_undoing_them(redis_url: str) -> None:
    env = {**os.environ, "REDIS_URL": redis_url, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "mcp_saga.cli", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") == 4}
    assert "1 reservation active" in rows["inventory"] and "1 reservation released" in rows["inventory"]
    assert "1 charge charged" in rows["payments"] and "1 charge refunded" in rows["payments"]
    timeline = [line for line in out.splitlines() if "compensation-succeeded" in line]
    assert len(timeline) == 2
    assert "payments" in timeline[0] and "inventory" in timeline[1]  # reverse completion order
    # The demo itself never names a compensating tool: that knowledge comes from the servers.
    source = (ROOT / "cli" / "demo.py").read_text()
    assert "refund_payment" not in source and "release_inventory" not in source and "cancel_shipment" not in source


def _commands() -> list[list[str]]:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return [s["command"] for s in compose["services"].values() if "command" in s]


def test_compose_runs_only_commands_that_exist() -> None:
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    checked = 0
    for command in _commands():
        if command[0] == "saga":
            assert command[1] in subcommands, command
            build_parser().parse_args(command[1:])  # the arguments parse too
        elif command[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(command[2]) is not None, command
            if command[2].startswith("examples."):
                from mcp_saga.examples.serve import parse_args

                parse_args(command[2].split(".")[1], command[3:])
        elif command[0] == "redis-server":
            assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
        elif command[:2] == ["sh", "-c"] and "--sentinel" in command[2]:  # the sentinel profile writes its config
            assert "sentinel monitor mymaster redis 6379" in command[2]
        elif command[:2] == ["sh", "-c"]:  # the cluster profile's one-off `redis-cli --cluster create`
            assert "redis-cli --cluster create" in command[2] and "--cluster-replicas 1" in command[2]
        else:
            raise AssertionError(f"unexpected command {command}")
        checked += 1
    assert checked >= 6


def test_compose_config_is_a_valid_saga_config() -> None:
    from mcp_saga.schemas.config import load_config

    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    config = load_config(ROOT / "deploy" / "saga.toml")
    assert set(config.servers) == {"inventory", "payments", "shipping"}
    for name in config.servers:
        assert name in compose["services"], f"{name} in deploy/saga.toml has no compose service"
    assert "worker" in compose["services"] and "deploy" not in compose["services"]["worker"]  # scalable
    cluster = load_config(ROOT / "deploy" / "saga-cluster.toml")  # the `cluster` profile's
    assert cluster.redis.cluster and cluster.redis.partitions == 3 and cluster.servers == config.servers
    profiled = {name for name, s in compose["services"].items() if "cluster" in s.get("profiles", [])}
    assert {"coordinator-cluster", "worker-cluster", *(f"redis-node-{n}" for n in range(1, 7))} <= profiled
    sentinel = {name: s for name, s in compose["services"].items() if "sentinel" in s.get("profiles", [])}
    assert {"redis-replica", "sentinel", "coordinator-sentinel", "worker-sentinel"} <= set(sentinel)
    from mcp_saga.runtime.sentinel import parse_sentinel_url

    assert parse_sentinel_url(sentinel["coordinator-sentinel"]["environment"]["REDIS_URL"]).master == "mymaster"
