"""SEP-3172 recovery declared on a server, listed over stdio and streamable HTTP, read back whole.

The server under test is this module itself (`python -m test_recovery_wire`), so that the
declarations and the expectations sit side by side. Besides honest declarations it carries a
hostile middleware that pages the listing and plants conflicting, invalid and malformed recovery.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer
from mcp_saga.runtime.recovery_wire import (
    IDEMPOTENCY_META_KEY,
    RECOVERY_META_KEY,
    RecoveryAnnotations,
    ToolDeclaration,
    compensation,
    declaration_from_wire,
    idempotency_key,
    read_tool_declarations,
    recoverable_tool,
)
from mcp_saga.schemas.recovery import RecoveryError
from mcp_types import ToolAnnotations
from processes import REPO, start_http_server, stdio_params

MODULE = "test_recovery_wire"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
PAGE_SIZE = 2

DECLARED = compensation("undo", id="$response.body#/id")
OTHER = compensation("undo", id="$response.body#/otherId")
INVALID = {"strategy": "compensation", "compensatingOperation": {"operationId": "undo", "parameters": {"id": "$url"}}}
MALFORMED = "undo it somehow"
PLANTED = {"conflicting": OTHER, "invalid": INVALID, "malformed": MALFORMED}


def build_server() -> MCPServer:
    app = MCPServer("wire-fixture", log_level="WARNING")

    @recoverable_tool(app, DECLARED, annotations=ToolAnnotations(destructiveHint=False))
    def do(n: int) -> dict[str, str]:
        return {"id": f"id-{n}"}

    @app.tool()
    def undo(id: str) -> str:
        return id

    @app.tool()
    def plain() -> str:
        return "nothing to undo"

    @app.tool(meta={RECOVERY_META_KEY: DECLARED})
    def meta_only() -> dict[str, str]:
        return {"id": "m"}

    @app.tool(meta={RECOVERY_META_KEY: DECLARED})
    def conflicting() -> dict[str, str]:
        return {"id": "c"}

    @app.tool()
    def invalid() -> str:
        return "i"

    @app.tool()
    def malformed() -> str:
        return "m"

    @app.tool()
    def echo_key(ctx: Context) -> dict[str, str | None]:
        return {"key": idempotency_key(ctx)}

    async def hostile(ctx: Any, call_next: Any) -> Any:
        result = await call_next(ctx)
        if ctx.method != "tools/list":
            return result
        for tool in result["tools"]:
            if tool["name"] in PLANTED:
                tool["annotations"] = {**(tool.get("annotations") or {}), "recovery": PLANTED[tool["name"]]}
        start = int((ctx.params or {}).get("cursor") or 0)
        page = {**result, "tools": result["tools"][start : start + PAGE_SIZE]}
        if start + PAGE_SIZE < len(result["tools"]):
            page["nextCursor"] = str(start + PAGE_SIZE)
        return page

    app.middleware.append(hostile)
    return app


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    with start_http_server(MODULE, env=ENV) as (_, url):
        yield url


@pytest.fixture(scope="module", params=["stdio", "http"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[Client]:
    target = stdio_params(MODULE, env=ENV) if request.param == "stdio" else request.getfixturevalue("http_url")
    async with Client(target) as connected:
        yield connected


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_declarations_read_back_over_the_wire(client: Client) -> None:
    tools = await read_tool_declarations(client)

    assert sorted(tools) == sorted(["do", "undo", "plain", "meta_only", *PLANTED, "echo_key"])  # every page
    do = tools["do"]
    assert (do.recovery, do.recovery_source, do.problem) == (DECLARED, "annotations", None)
    assert do.meta[RECOVERY_META_KEY] == DECLARED
    assert do.annotations["destructiveHint"] is False
    assert do.parsed_recovery() is not None and do.parsed_recovery().to_wire() == DECLARED
    assert do.declares_argument("n") and do.output_schema is not None
    for name in ("undo", "plain"):
        assert (tools[name].recovery, tools[name].recovery_source, tools[name].problem) == (None, None, None)
    assert (tools["meta_only"].recovery, tools["meta_only"].recovery_source) == (DECLARED, "meta")


@pytest.mark.anyio
async def test_hostile_declarations_are_kept_and_explained(client: Client) -> None:
    tools = await read_tool_declarations(client)

    conflicting = tools["conflicting"]
    assert (conflicting.recovery, conflicting.recovery_source) == (OTHER, "annotations")
    assert "differ" in conflicting.problem and RECOVERY_META_KEY in conflicting.problem
    for name in ("invalid", "malformed"):
        assert tools[name].recovery == PLANTED[name]
        assert tools[name].problem.startswith("invalid recovery declaration") and repr(name) in tools[name].problem
        assert tools[name].parsed_recovery() is None
    assert "$url" in tools["invalid"].problem


@pytest.mark.anyio
async def test_idempotency_key_reaches_the_tool(client: Client) -> None:
    keyed = await client.call_tool("echo_key", {}, meta={IDEMPOTENCY_META_KEY: "wf-1:step-2:undo"})
    bare = await client.call_tool("echo_key", {})

    assert keyed.structured_content == {"key": "wf-1:step-2:undo"}
    assert bare.structured_content == {"key": None}


def test_a_typo_fails_at_declaration_naming_the_tool() -> None:
    app = MCPServer("typo")
    with pytest.raises(RecoveryError, match=r"tool 'charge'.*\$response\.bdy"):

        @recoverable_tool(app, compensation("refund", id="$response.bdy#/id"))
        def charge() -> None: ...


def test_one_middleware_per_server() -> None:
    app = MCPServer("twice")
    for name in ("a", "b"):
        recoverable_tool(app, compensation("undo"), name=name)(lambda: None)

    [middleware] = [m for m in app.middleware if isinstance(m, RecoveryAnnotations)]
    assert sorted(middleware.declared) == ["a", "b"]


@pytest.mark.parametrize(
    "entry",
    [{}, {"name": 3}, {"name": "x", "annotations": "no", "_meta": [], "inputSchema": None, "outputSchema": 1}],
)
def test_malformed_entries_never_raise(entry: dict[str, Any]) -> None:
    declaration = declaration_from_wire(entry)
    assert declaration is None or declaration == ToolDeclaration(name="x")


if __name__ == "__main__":
    if "--http" in sys.argv:
        build_server().run("streamable-http", host="127.0.0.1", port=int(sys.argv[sys.argv.index("--http") + 1]))
    else:
        build_server().run()
