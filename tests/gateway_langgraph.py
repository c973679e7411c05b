"""A LangGraph agent using the gateway through langchain-mcp-adapters: the README's LangGraph snippet.

langchain-mcp-adapters needs mcp 1.x, so this runs in its own virtual environment (see
tests/test_gateway.py), as an mcp 1.x client would in any other project:

    python gateway_langgraph.py GATEWAY_URL WORKFLOW      (token in $SAGA_GATEWAY_TOKEN)

No LLM: langchain-core's fake chat model emits the tool calls. It prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_mcp_adapters.client import MultiServerMCPClient
from langgraph.prebuilt import create_react_agent

SHARED_TOOLS = ("state", "saga_fail", "saga_complete")  # on every endpoint: keep each server's own


class ScriptedModel(GenericFakeChatModel):
    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


async def main(gateway: str, workflow: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {os.environ['SAGA_GATEWAY_TOKEN']}", "Saga-Workflow": workflow}
    client = MultiServerMCPClient(
        {
            server: {"url": f"{gateway}/mcp/{server}", "transport": "streamable_http", "headers": headers}
            for server in ("inventory", "payments", "shipping")
        }
    )
    tools = [tool for tool in await client.get_tools() if tool.name not in SHARED_TOOLS]
    script = [
        ("reserve_inventory", {"sku": "WIDGET-1", "quantity": 2}),
        ("charge_payment", {"orderId": workflow, "amount": 19.5}),
        ("create_shipment", {"orderId": workflow, "address": "1 Main St", "simulateFailure": True}),
    ]
    turns = [
        AIMessage(content="", tool_calls=[{"name": t, "args": a, "id": f"call-{n}"}]) for n, (t, a) in enumerate(script)
    ]
    agent = create_react_agent(ScriptedModel(messages=iter([*turns, AIMessage(content="done")])), tools)
    state = await agent.ainvoke({"messages": [("user", f"Ship order {workflow}")]})
    results = {m.name: m for m in state["messages"] if m.type == "tool"}

    failed = results["create_shipment"].status == "error"
    if failed:  # the app signals the failure through the gateway's saga_fail tool
        signals = {tool.name: tool for tool in await client.get_tools(server_name="shipping")}
        await signals["saga_fail"].ainvoke({"reason": "shipment failed"})
    return {
        "failed": failed,
        "reservationId": _field(results["reserve_inventory"], "reservationId"),
        "transactionId": _field(results["charge_payment"], "transactionId"),
    }


def _field(message: Any, key: str) -> Any:
    content = message.artifact.get("structured_content") if isinstance(message.artifact, dict) else None
    if content is None:
        blocks = message.content if isinstance(message.content, list) else [message.content]
        text = next(b["text"] if isinstance(b, dict) else b for b in blocks)
        content = json.loads(text)
    return content[key]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:3]))))
