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
from pathlib import Path
from typing import Any

import pytest
import redis
from mcp import Client, StdioServerParameters
from mcp_saga.schemas.config import load_config
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
    config = tmp_path / "saga.toml"
    config.write_text(
        f"""
[servers.memory]
command = ["{npm_bin / "mcp-server-memory"}"]
env = {{ MEMORY_FILE_PATH = "{memory}" }}

[servers.memory.recovery.create_entities]
strategy = "compensation"
compensatingOperation.operationId = "delete_entities"
compensatingOperation.parameters.entityNames = "$response.body#/entities/*/name"

[coordinator]
block_ms = 100

[worker]
attempts = 2
backoff_base = 0
"""
    )

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
