"""A PydanticAI agent using the gateway: the code the README's "Use it from any agent" shows.

No LLM: each framework's own scripted model emits the tool calls an LLM would. The app names the
workflow with the `Saga-Workflow` header and, when a step fails, signals it with `saga_fail` (a
gateway tool the config turned on); `saga fail WF --reason ...` from a shell does the same.
"""

from __future__ import annotations

import json
from typing import Any

ORDER_STEPS = [
    ("reserve_inventory", {"sku": "WIDGET-1", "quantity": 2}),
    ("charge_payment", {"orderId": "{order}", "amount": 19.5}),
    ("create_shipment", {"orderId": "{order}", "address": "1 Main St", "simulateFailure": True}),
]


SHARED_TOOLS = ("state", "saga_fail", "saga_complete")


def _script(order: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (tool, {k: v.format(order=order) if isinstance(v, str) else v for k, v in args.items()})
        for tool, args in ORDER_STEPS
    ]


async def run_pydantic_ai(gateway: str, token: str, workflow: str) -> dict[str, Any]:
    """PydanticAI: one MCPToolset per server, each pointed at the gateway; FunctionModel plays the LLM."""
    from pydantic_ai import Agent
    from pydantic_ai.mcp import MCPToolset
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    headers = {"Authorization": f"Bearer {token}", "Saga-Workflow": workflow}
    servers = {
        s: MCPToolset(f"{gateway}/mcp/{s}", headers=headers, id=s, tool_error_behavior="error")
        for s in ("inventory", "payments", "shipping")
    }
    # Each server's own tools only: `state` and the gateway's saga_* tools exist on every endpoint.
    toolsets = [t.filtered(lambda ctx, tool: tool.name not in SHARED_TOOLS) for t in servers.values()]
    script = _script(workflow)
    seen: dict[str, Any] = {}

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in getattr(m, "parts", ()) if isinstance(p, ToolReturnPart)]
        for part in returns:
            seen[part.tool_name] = part.content
        if len(returns) < len(script):
            tool, args = script[len(returns)]
            return ModelResponse(parts=[ToolCallPart(tool, args)])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), toolsets=toolsets)
    outcome: dict[str, Any] = {"failed": False}
    try:
        await agent.run("Ship order " + workflow)
    except Exception as exc:  # the shipment's isError, surfaced by the framework
        outcome["failed"] = True
        outcome["error"] = repr(exc)
        async with servers["shipping"] as shipping:  # the app signals the failure through the gateway
            await shipping.direct_call_tool("saga_fail", {"reason": f"shipment failed: {exc}"})
    outcome.update(_ids(seen))
    return outcome


def _ids(seen: dict[str, Any]) -> dict[str, Any]:
    """The reservation and transaction ids from what the agent saw, to look them up in the ledgers."""
    found: dict[str, Any] = {}
    for tool, key in (("reserve_inventory", "reservationId"), ("charge_payment", "transactionId")):
        found[key] = _find(seen.get(tool), key)
    return found


def _find(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        if key in value:
            return value[key]
        return next((found for v in value.values() if (found := _find(v, key)) is not None), None)
    if isinstance(value, list):
        return next((found for v in value if (found := _find(v, key)) is not None), None)
    if isinstance(value, str):
        try:
            return _find(json.loads(value), key)
        except ValueError:
            return None
    return None
