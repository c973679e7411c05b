"""A test MCP server that writes down the request `_meta` of each compensating call it receives.

    python -m tests.meta_server --http PORT --host HOST      (SAGA_TEST_META_LOG=PATH)

`add_note` is recoverable by `remove_note`; each `remove_note` appends its request `_meta` to
PATH as one JSON line, so a test sees what reached the server (the trace context in particular)
outside the product. With OTEL_* set it also exports the MCP SDK's server spans.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

from mcp.server.mcpserver import Context
from mcp_saga.examples.serve import new_app, parse_args, run
from mcp_saga.runtime import tracing
from mcp_saga.runtime.recovery_wire import compensation, recoverable_tool
from pydantic import BaseModel

NAME = "notes"


class Note(BaseModel):
    noteId: str


def main(argv: list[str]) -> None:
    args = parse_args(NAME, argv)
    tracing.setup("notes")  # the MCP SDK's server span of each call, when OTEL_* asks for traces
    log = open(os.environ["SAGA_TEST_META_LOG"], "a", buffering=1)  # noqa: SIM115 - server lifetime
    ids = itertools.count(1)
    app = new_app(NAME)

    @recoverable_tool(app, compensation("remove_note", noteId="$response.body#/noteId"))
    def add_note(text: str) -> Note:
        """Keep a note."""
        return Note(noteId=f"N-{next(ids)}")

    @app.tool()
    def remove_note(noteId: str, ctx: Context) -> Note:
        """Forget a note; writes down the request's `_meta`."""
        meta = ctx.request_context.meta
        log.write(
            json.dumps({"noteId": noteId, "meta": meta.model_dump() if hasattr(meta, "model_dump") else meta}) + "\n"
        )
        return Note(noteId=noteId)

    run(app, args)


if __name__ == "__main__":
    main(sys.argv[1:])
