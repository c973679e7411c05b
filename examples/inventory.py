"""Inventory server of the SEP's reference scenario: a reservation is undone by releasing it."""

from __future__ import annotations

import sys
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp_saga.examples.ledger import Ledger, Tx
from mcp_saga.examples.serve import main_for, new_app
from mcp_saga.runtime.recovery_wire import compensation, idempotency_key, recoverable_tool
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

NAME = "inventory"


class Reservation(BaseModel):
    reservationId: str
    sku: str
    quantity: int


class Release(BaseModel):
    reservationId: str
    sku: str
    quantity: int
    status: Literal["released"] = "released"


def build(ledger: Ledger) -> MCPServer:
    app = new_app(NAME, ledger)

    @recoverable_tool(
        app,
        compensation("release_inventory", reservationId="$response.body#/reservationId"),
        annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False),
    )
    def reserve_inventory(sku: str, quantity: Annotated[int, Field(ge=1)], ctx: Context) -> Reservation:
        """Hold `quantity` units of `sku` until they are shipped or released."""
        arguments = {"sku": sku, "quantity": quantity}

        def effect(tx: Tx) -> dict:
            reservation = tx.create("reservation", arguments, prefix="RSV", status="active")
            return {"reservationId": reservation, **arguments}

        return Reservation(**ledger.apply("reserve_inventory", idempotency_key(ctx), arguments, effect))

    @app.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=True))
    def release_inventory(reservationId: str, ctx: Context, idempotencyKey: str | None = None) -> Release:
        """Give a reservation's units back; refused for an unknown or already released reservation."""

        def effect(tx: Tx) -> dict:
            held = tx.transition("reservation", reservationId, allowed_from="active", to="released")
            return {"reservationId": reservationId, **held, "status": "released"}

        key = idempotency_key(ctx) or idempotencyKey
        arguments = {"reservationId": reservationId}
        return Release(**ledger.apply("release_inventory", key, arguments, effect, compensating=True))

    return app


def main(argv: list[str] | None = None) -> None:
    main_for(NAME, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
