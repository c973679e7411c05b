"""The orchestrators: publisher processes that run scripted workflows through the SDK and record what they committed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import redis

import mcp_saga
from bench.chaos.model import FORWARD, Settings

# The orchestrators ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One workflow's script: the calls in order, and where (and how) it fails, if it does."""

    steps: list[tuple[str, str, dict[str, Any]]]
    fail_at: int | None = None  # index of the step that fails (or before which the agent gives up)
    # "tool": the call fails (isError); "raise": the agent's own code raises; "lost": the agent gives up
    # on the call's answer (a short read timeout) while the server runs it, and fails the workflow
    mode: str | None = None


def plan_workflow(rng: random.Random, workflow: str, settings: Settings) -> Plan:
    """Every holding's data names its workflow and step, so even an effect nobody reported is traceable."""
    steps = []
    for i in range(rng.randint(settings.min_steps, settings.max_steps)):
        ref = f"{workflow}/{i}"
        match rng.choice(tuple(FORWARD)):
            case "reserve_inventory":
                steps.append(("inventory", "reserve_inventory", {"sku": ref, "quantity": rng.randint(1, 5)}))
            case "charge_payment":
                steps.append(("payments", "charge_payment", {"orderId": ref, "amount": rng.randint(100, 99_999) / 100}))
            case _:
                steps.append(("shipping", "create_shipment", {"orderId": ref, "address": f"{i} Chaos Street"}))
    if rng.random() >= settings.fail_share:
        return Plan(steps)
    if rng.random() < settings.lost_share:
        at = rng.randrange(len(steps))
        return Plan(steps[: at + 1], at, "lost")
    if rng.random() < 0.5:
        at = rng.randrange(len(steps))
        failing = {"orderId": f"{workflow}/{at}", "address": "nowhere", "simulateFailure": True}
        return Plan([*steps[:at], ("shipping", "create_shipment", failing)], at, "tool")
    return Plan(steps, rng.randint(0, len(steps)), "raise")


class AgentGaveUp(RuntimeError):
    """The orchestrator's own code failing between calls, as agents do."""


class Link:
    """One publisher's client for one server, reopened by its own task when a call finds it broken.

    An MCP client must be closed by the task that opened it, and one whose server went away stays
    broken, so workflows borrow the current client and report a broken one here.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None
        self.ready = asyncio.Event()
        self.broken = asyncio.Event()
        self.closing = False

    async def own(self) -> None:
        from mcp import Client

        while not self.closing:
            with contextlib.suppress(Exception):
                async with Client(self.url) as client:
                    self.client = client
                    self.ready.set()
                    await self.broken.wait()
            self.ready.clear()
            self.client = None
            self.broken.clear()
            if not self.closing:
                await asyncio.sleep(0.2)

    async def get(self, timeout: float) -> Any:
        async with asyncio.timeout(timeout):
            while True:
                await self.ready.wait()
                if self.client is not None:
                    return self.client

    def failed(self, client: Any) -> None:
        if client is self.client:
            self.broken.set()

    def close(self) -> None:
        self.closing = True
        self.broken.set()


async def run_workflow(
    workflow: str, plan: Plan, links: dict[str, Link], r: Any, settings: Settings, config: Any = None
) -> dict[str, Any]:
    """Run one workflow through the SDK; the record says what was committed and what was published.

    `wf.flush()` after each call makes the record exact: the SDK writes a step's event in the
    background, and only a confirmed write counts as published here.
    """
    from mcp_saga.orchestrator.wrapper import StepNotRecorded, ToolCallFailed

    record: dict[str, Any] = {
        "workflow": workflow, "planned": len(plan.steps), "mode": plan.mode, "steps": [], "unpublished": [],
        "outcome": None, "error": None, "terminalPublished": True,
    }  # fmt: skip
    try:
        clients = {name: await link.get(settings.publisher_call_timeout) for name, link in links.items()}
    except TimeoutError:
        record.update(outcome="not-started", terminalPublished=False, error="no MCP connection")
        return record
    body_done = False
    try:
        async with mcp_saga.workflow(workflow, redis=r, servers=clients, settle_timeout=10, config=config) as wf:
            for i, (server, tool, arguments) in enumerate(plan.steps):
                if plan.mode == "raise" and plan.fail_at == i:
                    raise AgentGaveUp(f"agent gave up before step {i}")
                lose = plan.mode == "lost" and plan.fail_at == i
                options = {"read_timeout_seconds": settings.lost_answer_after} if lose else {}
                try:
                    async with asyncio.timeout(settings.publisher_call_timeout):
                        result = await wf.call(server, tool, arguments, step=f"s{i}", **options)
                except (ToolCallFailed, StepNotRecorded):
                    raise
                except Exception as exc:
                    if lose:  # the injected give-up: the client itself is fine, only this answer is lost
                        record["lostAnswer"] = f"s{i}"
                    elif not isinstance(exc, redis.RedisError):  # the transport: this client is done for
                        links[server].failed(clients[server])
                    raise
                holding = (result.structured_content or {})[FORWARD[tool][1]]
                step = {"step": f"s{i}", "server": server, "tool": tool, "holding": holding}
                try:
                    await wf.flush()
                except StepNotRecorded:  # committed on the server, its event not confirmed in Redis
                    record["unpublished"].append(step)
                    raise
                record["steps"].append(step)
            if plan.mode == "raise" and plan.fail_at == len(plan.steps):
                raise AgentGaveUp("agent gave up after the last step")
            body_done = True
    except Exception as exc:
        record["outcome"] = "completed" if body_done else "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        notes = getattr(exc, "__notes__", [])
        record["terminalPublished"] = not body_done and not any("NOT published" in n for n in notes)
    else:
        record["outcome"] = "completed"
    return record


def refused(record: dict[str, Any]) -> bool:
    """Whether Redis refused the workflow a write (its step, its intent or its terminal event).

    Such a workflow fails in milliseconds, so a publisher that started the next one at once ran
    through most of its list while Redis was full: a 3 s fill of the full run failed 305 of 500
    workflows (seed 20261201 had 325), and its table said little. The publisher pauses instead,
    as an agent whose saga store refuses writes would back off.
    """
    failed = record["outcome"] == "failed" and not record["terminalPublished"]
    return failed or str(record.get("error") or "").startswith("StepNotRecorded")


async def publish(spec: dict[str, Any]) -> None:
    """One publisher process: `concurrency` workflows at a time, one JSON line per finished workflow."""
    from mcp_saga.runtime.connect import connect_async
    from mcp_saga.schemas.config import Config, RedisSettings
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    settings = Settings(**spec["settings"])
    # One client for all workflows, as an agent would have, retrying through a Redis restart. On a
    # cluster it is redis-py's cluster client, and the SDK routes each workflow's events to its
    # partition's stream from the config's `[redis]` table.
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=1.0), 10)
    where = RedisSettings(**spec.get("redis_settings", {}))
    config = Config(redis=where) if where.cluster else None
    r = connect_async(spec["redis"], where, retry=retry)
    links = {name: Link(url) for name, url in spec["urls"].items()}
    owners = [asyncio.create_task(link.own()) for link in links.values()]
    pending = list(reversed(spec["workflows"]))
    out = open(spec["records"], "a", buffering=1)  # noqa: SIM115 - closed below; a line per workflow

    async def loop() -> None:
        while pending:
            workflow = pending.pop()
            plan = plan_workflow(random.Random(f"{spec['seed']}:{workflow}"), workflow, settings)
            started = time.time()
            record = await run_workflow(workflow, plan, links, r, settings, config)
            record.update(started=started, ended=time.time())
            out.write(json.dumps(record) + "\n")
            if refused(record):
                await asyncio.sleep(settings.refused_pause)

    try:
        await asyncio.gather(*(loop() for _ in range(settings.concurrency)))
    finally:
        out.close()
        for link in links.values():
            link.close()
        await asyncio.wait(owners, timeout=10)
        await r.aclose()
