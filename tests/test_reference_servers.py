"""Operator overlays against the official reference servers from npm, over stdio, end to end.

Real `saga coordinator` and `saga worker` processes, a real redis-server, and the servers the MCP
project itself publishes, which declare no SEP-3172 recovery; the operator's config does:

- `@modelcontextprotocol/server-memory`: `create_entities` is undone by `delete_entities`, which
  takes a list of names. Bound with the `*` projection, `$response.body#/entities/*/name`; the
  knowledge graph itself must show the entities gone.
- `@modelcontextprotocol/server-filesystem`: it has no delete tool, and `move_file` is undone by
  `move_file` with source and destination swapped (a self-inverse compensation, declared by the
  operator); the directory itself must show the file back where it was.

The packages are installed once into `.cache/npm-servers` (npm reaches its registry from CI too);
the tests skip only when npm itself is missing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp import Client, StdioServerParameters
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import load_config, parse_config, write_config
from mcp_saga.schemas.keys import Keys
from processes import saga_process, stop, wait_for

import mcp_saga

ROOT = Path(__file__).resolve().parent.parent
NPM_DIR = ROOT / ".cache" / "npm-servers"
PACKAGES = ("@modelcontextprotocol/server-memory", "@modelcontextprotocol/server-filesystem")
K = Keys()


@pytest.fixture(scope="session")
def npm_bin() -> Path:
    """The servers' executables, installed once and reused."""
    bin_dir = NPM_DIR / "node_modules" / ".bin"
    if not all((bin_dir / name).exists() for name in ("mcp-server-memory", "mcp-server-filesystem")):
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed")
        NPM_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(NPM_DIR), *PACKAGES],
            check=True,
            timeout=600,
        )
    return bin_dir


def saga_config(path: Path, **servers: dict[str, Any]) -> Path:
    """A config with quick settings, built and checked by the config model."""
    data = {"servers": servers, "coordinator": {"block_ms": 100}, "worker": {"attempts": 2, "backoff_base": 0}}
    return write_config(parse_config(data), path)


def run_unwind(r: redis.Redis, redis_url: str, config: Path, tmp_path: Path, workflow: str, calls: Any) -> bytes:
    """Run `calls(wf)` in a workflow that then fails, with a coordinator and a worker; the end status."""
    procs = [
        saga_process(role, redis_url=redis_url, config=config, log=tmp_path / f"{role}.log")
        for role in ("coordinator", "worker")
    ]
    try:
        asyncio.run(calls(workflow))
        status = wait_for(
            lambda: (
                r.hget(K.state(workflow), "status") in (b"compensated", b"needs-attention")
                and r.hget(K.state(workflow), "status")
            ),
            60,
            "the unwind",
        )
    finally:
        for proc in procs:
            stop(proc)
    return status


def test_create_entities_is_undone_by_delete_entities_through_a_projection(
    r: redis.Redis, redis_url: str, tmp_path: Path, npm_bin: Path
) -> None:
    memory = tmp_path / "memory.jsonl"
    server = StdioServerParameters(command=str(npm_bin / "mcp-server-memory"), env={"MEMORY_FILE_PATH": str(memory)})
    memory_server = {
        "command": [str(npm_bin / "mcp-server-memory")],
        "env": {"MEMORY_FILE_PATH": str(memory)},
        "recovery": {"create_entities": compensation("delete_entities", entityNames="$response.body#/entities/*/name")},
    }
    config = saga_config(tmp_path / "saga.toml", memory=memory_server)

    def entity(name: str) -> dict[str, Any]:
        return {"name": name, "entityType": "person", "observations": []}

    async def graph() -> list[str]:
        async with Client(server) as client:
            result = await client.call_tool("read_graph", {})
            return sorted(e["name"] for e in result.structured_content["entities"])

    async def calls(workflow: str) -> None:
        async with Client(server) as client:
            await client.call_tool("create_entities", {"entities": [entity("Grace")]})  # before, not ours to undo
            with pytest.raises(RuntimeError, match="later step"):
                async with mcp_saga.workflow(
                    workflow, redis=redis_url, servers={"memory": client}, config=load_config(config)
                ) as wf:
                    # Grace exists already: the server creates (and returns) only Ada and Bob.
                    await wf.call(
                        "memory", "create_entities", {"entities": [entity(n) for n in ("Ada", "Bob", "Grace")]}
                    )
                    raise RuntimeError("a later step failed")

    status = run_unwind(r, redis_url, config, tmp_path, "memory-1", calls)

    assert status == b"compensated", (tmp_path / "worker.log").read_text()[-3000:]
    record = json.loads(r.hget(K.comp("memory-1"), "1-create_entities"))
    assert (record["source"], record["operationId"], record["arguments"]) == (
        "overlay",
        "delete_entities",
        {"entityNames": ["Ada", "Bob"]},
    )
    assert asyncio.run(graph()) == ["Grace"]  # the graph itself says: Ada and Bob are gone


def test_move_file_is_undone_by_move_file_with_the_paths_swapped(
    r: redis.Redis, redis_url: str, tmp_path: Path, npm_bin: Path
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "report.txt").write_text("quarterly figures\n")
    command = [str(npm_bin / "mcp-server-filesystem"), str(files)]
    # The server has no delete tool: moving the file back is the undo, and the operator says so.
    swap = compensation("move_file", source="$request.body#/destination", destination="$request.body#/source")
    config = saga_config(tmp_path / "saga.toml", fs={"command": command, "recovery": {"move_file": swap}})

    async def calls(workflow: str) -> None:
        async with Client(StdioServerParameters(command=command[0], args=command[1:])) as client:
            with pytest.raises(RuntimeError, match="later step"):
                async with mcp_saga.workflow(
                    workflow, redis=redis_url, servers={"fs": client}, config=load_config(config)
                ) as wf:
                    moved = {"source": str(files / "report.txt"), "destination": str(files / "archived.txt")}
                    await wf.call("fs", "move_file", moved)
                    assert (files / "archived.txt").exists()
                    raise RuntimeError("a later step failed")

    status = run_unwind(r, redis_url, config, tmp_path, "fs-1", calls)

    assert status == b"compensated", (tmp_path / "worker.log").read_text()[-3000:]
    assert sorted(p.name for p in files.iterdir()) == ["report.txt"]  # back where it was
    assert (files / "report.txt").read_text() == "quarterly figures\n"
    record = json.loads(r.hget(K.comp("fs-1"), "1-move_file"))
    assert (record["source"], record["operationId"], record["arguments"]) == (
        "overlay",
        "move_file",
        {"source": str(files / "archived.txt"), "destination": str(files / "report.txt")},
    )


def test_a_config_that_could_only_be_refused_stops_start_up_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[servers.fs]\ncommand = ["mcp-server-filesystem"]\n\n[policy]\nself_inverse = ["move_file"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "mcp_saga.cli", "worker", "--config", str(config), "--redis", "redis://127.0.0.1:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2
    assert "policy.self_inverse.0: 'move_file' is not a server:tool pattern" in done.stderr
