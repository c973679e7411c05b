"""Shipping server of the SEP's reference scenario: the step that fails when told to."""

from __future__ import annotations

import sys
from typing import Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_saga.examples.ledger import Ledger, Tx
from mcp_saga.examples.serve import main_for, new_app
from mcp_saga.runtime.recovery_wire import compensation, idempotency_key, recoverable_tool
from mcp_types import ToolAnnotations
from pydantic import BaseModel

NAME = "shipping"
SIMULATED_FAILURE = "carrier rejected the shipment (simulated failure)"


class Shipment(BaseModel):
    shipmentId: str
    orderId: str
    address: str
    status: Literal["created"] = "created"


class Cancellation(BaseModel):
    shipmentId: str
    orderId: str
    address: str
    status: Literal["cancelled"] = "cancelled"


def build(ledger: Ledger) -> MCPServer:
    app = new_app(NAME, ledger)

    @recoverable_tool(
        app,
        compensation("cancel_shipment", shipmentId="$response.body#/shipmentId"),
        annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False),
    )
    def create_shipment(orderId: str, address: str, ctx: Context, simulateFailure: bool = False) -> Shipment:
        """Book a shipment for an order; `simulateFailure` makes the carrier refuse, changing nothing."""
        if simulateFailure:
            raise ToolError(SIMULATED_FAILURE)
        arguments = {"orderId": orderId, "address": address}

        def effect(tx: Tx) -> dict:
            shipment = tx.create("shipment", arguments, prefix="SHP", status="created")
            return {"shipmentId": shipment, **arguments}

        return Shipment(**ledger.apply("create_shipment", idempotency_key(ctx), arguments, effect))

    @app.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=True))
    def cancel_shipment(shipmentId: str, ctx: Context, idempotencyKey: str | None = None) -> Cancellation:
        """Cancel a shipment; refused for an unknown or already cancelled shipment."""

        def effect(tx: Tx) -> dict:
            booked = tx.transition("shipment", shipmentId, allowed_from="created", to="cancelled")
            return {"shipmentId": shipmentId, **booked, "status": "cancelled"}

        key = idempotency_key(ctx) or idempotencyKey
        arguments = {"shipmentId": shipmentId}
        return Cancellation(**ledger.apply("cancel_shipment", key, arguments, effect, compensating=True))

    return app


def main(argv: list[str] | None = None) -> None:
    main_for(NAME, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
