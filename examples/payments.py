"""Payments server of the SEP's reference scenario: a charge is undone by refunding it."""

from __future__ import annotations

import sys
from typing import Annotated, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp_saga.examples.ledger import Ledger, Tx
from mcp_saga.examples.serve import main_for, new_app
from mcp_saga.runtime.recovery_wire import compensation, idempotency_key, recoverable_tool
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

NAME = "payments"


class Charge(BaseModel):
    transactionId: str
    orderId: str
    amount: float
    currency: str
    status: Literal["charged"] = "charged"


class Refund(BaseModel):
    transactionId: str
    refundId: str
    orderId: str
    amount: float
    currency: str
    status: Literal["refunded"] = "refunded"


class OrderRefund(BaseModel):
    orderId: str
    refunded: list[str]


def build(ledger: Ledger) -> MCPServer:
    app = new_app(NAME, ledger)

    @recoverable_tool(
        app,
        compensation("refund_payment", transactionId="$response.body#/transactionId"),
        annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False),
    )
    def charge_payment(
        orderId: str, amount: Annotated[float, Field(gt=0)], ctx: Context, currency: str = "USD"
    ) -> Charge:
        """Charge `amount` for an order; returns the transaction to refund if the order falls through."""
        arguments = {"orderId": orderId, "amount": amount, "currency": currency}

        def effect(tx: Tx) -> dict:
            transaction = tx.create("charge", arguments, prefix="TXN", status="charged")
            return {"transactionId": transaction, **arguments}

        return Charge(**ledger.apply("charge_payment", idempotency_key(ctx), arguments, effect))

    @app.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=True))
    def refund_payment(transactionId: str, ctx: Context, idempotencyKey: str | None = None) -> Refund:
        """Refund a charge in full; refused for an unknown or already refunded transaction."""

        def effect(tx: Tx) -> dict:
            charged = tx.transition("charge", transactionId, allowed_from="charged", to="refunded")
            refund_id = f"RFD-{transactionId.removeprefix('TXN-')}"
            return {"transactionId": transactionId, "refundId": refund_id, **charged, "status": "refunded"}

        key = idempotency_key(ctx) or idempotencyKey
        arguments = {"transactionId": transactionId}
        return Refund(**ledger.apply("refund_payment", key, arguments, effect, compensating=True))

    @app.tool(annotations=ToolAnnotations(destructiveHint=True, idempotentHint=True))
    def refund_order(orderId: str, ctx: Context, idempotencyKey: str | None = None) -> OrderRefund:
        """Refund every charge of an order; an order with no charge (the charge never happened) refunds
        nothing and succeeds: the undo of a call whose outcome is unknown, bound from its request alone."""

        def effect(tx: Tx) -> dict:
            charges = tx.holdings_where("charge", "orderId", orderId, "charged")
            for transaction in charges:
                tx.transition("charge", transaction, allowed_from="charged", to="refunded")
            return {"orderId": orderId, "refunded": charges}

        key = idempotency_key(ctx) or idempotencyKey
        return OrderRefund(**ledger.apply("refund_order", key, {"orderId": orderId}, effect, compensating=True))

    return app


def main(argv: list[str] | None = None) -> None:
    main_for(NAME, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
