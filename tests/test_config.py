"""The config model writes the files the demo, the tests and the benchmarks hand their processes."""

from __future__ import annotations

from pathlib import Path

from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import (
    Config,
    CoordinatorSettings,
    Policy,
    ServerConfig,
    WorkerSettings,
    dump_config,
    load_config,
    parse_config,
    write_config,
)


def test_a_written_config_loads_back_equal(tmp_path: Path) -> None:
    config = Config(
        prefix="shop",
        servers={
            "payments": ServerConfig(url="http://127.0.0.1:8001/mcp", timeout=5, headers_from_env={"X-Key": "PAY"}),
            "git": ServerConfig(
                command=["mcp-server-git", "--repository", "/srv/repo"],
                recovery=parse_config(
                    {
                        "servers": {
                            "g": {
                                "command": ["x"],
                                "recovery": {"git_add": compensation("git_reset", p="$request.body#/p")},
                            }
                        }
                    }
                )
                .servers["g"]
                .recovery,
            ),
        },
        policy=Policy(approval=["payments:refund_*"], deny=["git:*"]),
        coordinator=CoordinatorSettings(block_ms=50),
        worker=WorkerSettings(attempts=2, backoff_base=0),
    )
    assert load_config(write_config(config, tmp_path / "saga.toml")) == config


def test_only_what_differs_from_the_defaults_is_written() -> None:
    text = dump_config(Config(worker=WorkerSettings(attempts=3)))
    assert text.strip() == "[worker]\nattempts = 3"
    assert dump_config(Config()) == ""
