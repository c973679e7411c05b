"""Recovery overlays against a real third-party server: the official `mcp-server-git`, over stdio.

mcp-server-git declares no SEP-3172 recovery. The operator's config does: `git_add` is undone by
`git_reset`, bound with `$request.body#/repo_path`. A workflow stages a file, a later step fails,
and the repository itself must show nothing staged afterwards. Its results are plain text, so a
`$response.body` binding must make the step unrecoverable, cleanly.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import redis
from mcp import Client, StdioServerParameters
from mcp_saga.cli.main import main as saga_main
from mcp_saga.runtime.recovery_wire import compensation
from mcp_saga.schemas.config import load_config, parse_config, write_config
from mcp_saga.schemas.keys import Keys
from processes import saga_process, stop, wait_for

import mcp_saga

ROOT = Path(__file__).resolve().parent.parent
GIT_VENV = ROOT / ".cache" / "mcp-server-git"
K = Keys()


@pytest.fixture(scope="session")
def mcp_server_git() -> Path:
    """The server in its own virtual environment (it pins its own mcp), built once and reused."""
    binary = GIT_VENV / "bin" / "mcp-server-git"
    if not binary.exists():
        venv.create(GIT_VENV, with_pip=True, clear=True)
        subprocess.run(
            [GIT_VENV / "bin" / "python", "-m", "pip", "install", "-q", "mcp-server-git"], check=True, timeout=600
        )
    return binary


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@example.org"], ["config", "user.name", "t"]):
        git(path, *args)
    (path / "README").write_text("hello\n")
    git(path, "add", "README")
    git(path, "commit", "-qm", "init")
    (path / "new.txt").write_text("staged by the agent\n")
    return path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def git_config(path: Path, binary: Path, repo: Path) -> Path:
    git = {
        "command": [str(binary), "--repository", str(repo)],
        "timeout": 20,
        "recovery": {
            "git_add": compensation("git_reset", repo_path="$request.body#/repo_path"),
            # Plain-text results: this binding can never resolve, so the step must be unrecoverable.
            "git_status": compensation("git_reset", repo_path="$response.body#/repo"),
        },
    }
    data = {"servers": {"git": git}, "coordinator": {"block_ms": 100}, "worker": {"attempts": 2, "backoff_base": 0}}
    write_config(parse_config(data), path)
    return path


async def run_failing_workflow(workflow: str, redis_url: str, config: Path, binary: Path, repo: Path, tool: str):
    params = StdioServerParameters(command=str(binary), args=["--repository", str(repo)])
    async with Client(params) as client:
        with pytest.raises(RuntimeError, match="later step"):
            async with mcp_saga.workflow(
                workflow, redis=redis_url, servers={"git": client}, config=load_config(config)
            ) as wf:
                arguments = {"repo_path": str(repo)} | ({"files": ["new.txt"]} if tool == "git_add" else {})
                await wf.call("git", tool, arguments)
                raise RuntimeError("a later step failed")


def test_git_add_is_undone_by_the_overlay(
    r: redis.Redis, redis_url: str, tmp_path: Path, mcp_server_git: Path, repo: Path, capsys
) -> None:
    config = git_config(tmp_path / "saga.toml", mcp_server_git, repo)
    procs = [
        saga_process(role, redis_url=redis_url, config=config, log=tmp_path / f"{role}.log")
        for role in ("coordinator", "worker")
    ]
    try:
        asyncio.run(run_failing_workflow("git-1", redis_url, config, mcp_server_git, repo, "git_add"))
        status = wait_for(
            lambda: (
                r.hget(K.state("git-1"), "status") in (b"compensated", b"needs-attention")
                and r.hget(K.state("git-1"), "status")
            ),
            60,
            "the unwind",
        )
        assert status == b"compensated", (tmp_path / "worker.log").read_text()[-3000:]
        assert git(repo, "diff", "--cached", "--name-only") == ""  # the repository says: nothing staged
        assert "?? new.txt" in git(repo, "status", "--porcelain")  # the file itself is left alone

        record = json.loads(r.hget(K.comp("git-1"), "1-git_add"))
        assert (record["source"], record["operationId"], record["arguments"]) == (
            "overlay",
            "git_reset",
            {"repo_path": str(repo)},
        )
        capsys.readouterr()
        assert saga_main(["inspect", "git-1", "--json", "--redis", redis_url]) == 0
        inspected = json.loads(capsys.readouterr().out)
        assert "overlay" in json.dumps(inspected["compensations"])

        # Plain-text result + `$response.body` binding: unrecoverable with the reason, never called.
        asyncio.run(run_failing_workflow("git-2", redis_url, config, mcp_server_git, repo, "git_status"))
        wait_for(lambda: r.hget(K.state("git-2"), "status") == b"needs-attention", 60, "needs-attention")
        record = json.loads(r.hget(K.comp("git-2"), "1-git_status"))
        assert record["status"] == "unrecoverable" and record["arguments"] is None
        assert "$response.body" in record["reason"] and "JSON" in record["reason"]
    finally:
        for proc in procs:
            assert stop(proc) == 0


def test_a_malformed_overlay_stops_start_up_naming_server_tool_and_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(
        '[servers.git]\ncommand = ["mcp-server-git"]\n\n[servers.git.recovery.git_add]\nstrategy = "compensation"\n'
        'compensatingOperation = { operationId = "git reset", parameters = { repo_path = "$request.query.x" } }\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "mcp_saga.cli", "worker", "--config", str(config), "--redis", "redis://127.0.0.1:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "servers.git.recovery.git_add.compensatingOperation.operationId" in done.stderr
    assert "'git reset'" in done.stderr
