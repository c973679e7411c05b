"""A server whose tools do nothing, so benchmarks measure the saga machinery and MCP alone.

Same command line as the other examples; `--db` is accepted and ignored (there is no state),
`--fail-first` counts per process, in memory, and `--delay S` makes each `noop_undo` take S
seconds (a slow server; a hung one with a huge S). With `SAGA_TRIVIAL_ARRIVALS=PATH`, each `noop_undo`
appends "<unix time> <n>" to PATH when it arrives, so the latency benchmark can see when a
compensation reached the server (same machine, same clock).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import defaultdict

import anyio
from mcp.server.mcpserver import MCPServer
from mcp_saga.examples.ledger import Faults
from mcp_saga.examples.serve import new_app, parse_args, run
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool
from mcp_types import ToolAnnotations
from pydantic import BaseModel

NAME = "trivial"


class Noop(BaseModel):
    n: int


class Big(BaseModel):
    n: int
    data: str


class NoopUndo(BaseModel):
    n: int
    undone: bool = True


def build(faults: Faults | None = None) -> MCPServer:
    faults = faults or Faults()
    calls: defaultdict[str, itertools.count[int]] = defaultdict(lambda: itertools.count(1))
    arrivals_path = os.environ.get("SAGA_TRIVIAL_ARRIVALS")
    arrivals = open(arrivals_path, "a", buffering=1) if arrivals_path else None  # noqa: SIM115 - server lifetime
    app = new_app(NAME)

    @recoverable_tool(app, compensation("noop_undo", n="$response.body#/n"))
    def noop(n: int) -> Noop:
        """Return `n`."""
        return Noop(n=n)

    @recoverable_tool(app, compensation("noop_undo", n="$response.body#/n"))
    def big(n: int, size: int) -> Big:
        """Return `n` with `size` bytes of data: a result far over the 256 KiB event cap."""
        return Big(n=n, data="x" * size)

    @app.tool(annotations=ToolAnnotations(idempotentHint=True))
    async def noop_undo(n: int, idempotencyKey: str | None = None) -> NoopUndo:
        """Pretend to undo `noop(n)`, taking `--delay` seconds (an async sleep: other calls go on)."""
        if arrivals is not None:
            arrivals.write(f"{time.time():.6f} {n}\n")
        faults.check("noop_undo", next(calls["noop_undo"]))
        if faults.delay:
            await anyio.sleep(faults.delay)
        return NoopUndo(n=n)

    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args(NAME, argv)
    run(build(args.faults), args)


if __name__ == "__main__":
    main(sys.argv[1:])
