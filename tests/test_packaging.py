"""The wheel: one import root, usable from a project that has its own `schemas`, `workers`, `saga`.

Built here from the checkout and unpacked into a temporary directory (a wheel is a zip; unpacking it
is what pip's install does for a pure-Python wheel), so these tests see what a user installs, not the
editable checkout. The layers contract is checked against the same tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = dist.glob("mcp_saga-*.whl")
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    yield target


def test_the_wheel_installs_one_import_root(installed: Path) -> None:
    roots = {p.name for p in installed.iterdir() if not p.name.endswith(".dist-info")}
    assert roots == {"mcp_saga"}
    parts = ("schemas", "runtime", "coordinator", "workers", "orchestrator", "cli", "examples", "gateway", "console")
    for part in parts:
        assert (installed / "mcp_saga" / part / "__init__.py").is_file(), part
    assert list((installed / "mcp_saga" / "coordinator" / "lua").glob("*.lua")), "Lua scripts are package data"
    assert {p.name for p in (installed / "mcp_saga" / "workers" / "lua").glob("*.lua")} == {"release.lua", "renew.lua"}
    assert list((installed / "mcp_saga" / "schemas" / "json").glob("*.json")), "JSON Schemas are package data"
    console = installed / "mcp_saga" / "console"
    assert (console / "templates" / "workflow.html").is_file() and (console / "static" / "console.js").is_file()
    assert list((installed / "mcp_saga" / "runtime" / "lua").glob("*.lua")), "the metrics lease script is package data"


def test_sdk_imports_in_a_project_with_its_own_schemas_workers_and_saga(installed: Path, tmp_path: Path) -> None:
    project = tmp_path / "fastapi-app"
    (project / "workers").mkdir(parents=True)
    (project / "schemas.py").write_text("class Item: ...\n")
    (project / "workers" / "__init__.py").write_text("raise ImportError('the project workers were imported')\n")
    (project / "saga.py").write_text("raise ImportError('the project saga.py was imported')\n")
    (project / "coordinator.py").write_text("raise ImportError('the project coordinator.py was imported')\n")
    script = (
        "import schemas, mcp_saga, mcp_saga.coordinator.consumer, mcp_saga.workers.job, mcp_saga.cli.main\n"
        "assert schemas.Item, 'the project schemas module still works'\n"
        "from mcp_saga.coordinator.store import load_script\n"
        "assert 'redis.call' in load_script('apply.lua'), 'the Lua scripts load from the package'\n"
        "print(mcp_saga.__file__)\n"
        "print(mcp_saga.workflow.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    where, module = done.stdout.split()
    assert Path(where).is_relative_to(installed), "imported from the wheel, not the checkout"
    assert module == "mcp_saga.orchestrator.wrapper"


def test_layers_contract_holds(installed: Path, tmp_path: Path) -> None:
    """import-linter's layers contract (pyproject.toml) over the installed tree: no import goes upward."""
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
