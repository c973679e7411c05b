"""The README's copy-paste examples, executed as written."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
from mcp_saga.schemas.keys import Keys
from processes import saga_process, stop, wait_for

README = Path(__file__).resolve().parent.parent / "README.md"


def block_after(marker: str) -> list[str]:
    text = README.read_text()
    match = re.search(rf"<!-- {marker} -->\n```sh\n(.*?)```", text, re.S)
    assert match, f"README has no block marked {marker}"
    return [line for line in match.group(1).splitlines() if line.strip()]


def run_redis_cli_block(marker: str, redis_url: str) -> None:
    """Run the README's redis-cli block after `marker`, line by line, against `redis_url`."""
    for line in block_after(marker):
        assert line.startswith("redis-cli ")
        command = line.replace("redis-cli ", f"redis-cli -u {redis_url} ", 1)
        subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_redis_cli_publishing_example_is_compensated(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    coordinator = saga_process("coordinator", redis_url=redis_url, log=tmp_path / "coordinator.log")
    try:
        run_redis_cli_block("redis-cli-example", redis_url)
        keys = Keys()
        wait_for(lambda: r.hget(keys.state("order-7"), "status") == b"compensating", 20, "the coordinator")
        record = json.loads(r.hget(keys.comp("order-7"), "charge"))
        assert record["operationId"] == "refund_payment"
        assert record["arguments"] == {"transactionId": "TXN-7"}
        assert record["status"] == "queued"
        assert not r.xlen(keys.dead_letter)
    finally:
        assert stop(coordinator) == 0


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli is not installed")
def test_redis_cli_intent_example_is_in_doubt_and_undone_by_request(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    coordinator = saga_process("coordinator", redis_url=redis_url, log=tmp_path / "coordinator.log")
    try:
        run_redis_cli_block("redis-cli-intent-example", redis_url)
        keys = Keys()
        wait_for(lambda: r.hget(keys.state("order-8"), "status") == b"compensating", 20, "the coordinator")
        record = json.loads(r.hget(keys.comp("order-8"), "charge"))
        assert (record["operationId"], record["arguments"]) == ("refund_order", {"orderId": "order-8"})
        assert (record["status"], record["inDoubt"], record["forwardKey"]) == ("queued", True, "order-8/charge")
        assert not r.xlen(keys.dead_letter)
    finally:
        assert stop(coordinator) == 0


def test_configuration_reference_is_a_valid_config() -> None:
    import tomllib

    from mcp_saga.schemas.config import parse_config

    section = README.read_text().split("## Configuration", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block
    config = parse_config(tomllib.loads(block.group(1)), source="README")
    assert set(config.servers) == {"payments", "inventory", "git"}
    assert config.policy.decide("payments", "refund_payment") == "approval"
    assert config.overlay("git", "git_add") is not None
    defaults = parse_config({})
    # The reference shows the defaults: keep the two in step.
    assert config.coordinator == defaults.coordinator
    assert config.console == defaults.console
    assert config.worker == defaults.worker


def test_gateway_snippets_are_the_code_the_tests_run() -> None:
    """Each "Use it from any agent" snippet is lines of the client the gateway tests run, in order."""
    text = README.read_text()
    snippets = re.findall(r"<!-- gateway-snippet (\S+) -->\n```\w+\n(.*?)```", text, re.S)
    assert {path for path, _ in snippets} == {
        "tests/gateway_clients.py",
        "tests/gateway_langgraph.py",
        "tests/gateway_client.mjs",
    }
    for path, snippet in snippets:
        source = iter(line.strip() for line in (README.parent / path).read_text().splitlines())
        for line in filter(None, (line.strip() for line in snippet.splitlines())):
            assert any(line == candidate for candidate in source), f"{path} has no line {line!r} (in this order)"


def test_gateway_reference_shows_the_defaults() -> None:
    import tomllib

    from mcp_saga.schemas.config import parse_config

    section = README.read_text().split("## Configuration", 1)[1]
    block = re.search(r"```toml\n(.*?)```", section, re.S)
    assert block
    assert parse_config(tomllib.loads(block.group(1)), source="README").gateway == parse_config({}).gateway
