"""`saga demo`: SEP-3172's reference scenario with real processes, twice, side by side.

reserve_inventory -> charge_payment -> create_shipment (which fails). The baseline orchestrator
reads only today's ToolAnnotations, so the stock stays reserved and the card charged. The second
run goes through mcp-saga: the orchestrator SDK publishes each step, a coordinator process plans
the compensations from the servers' own declarations and a worker process performs them.

This module names no compensating tool: what undoes what comes only from the servers' tools/list.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import redis
from mcp_saga.cli.redis_server import resolve_redis
from mcp_saga.schemas.config import Config, CoordinatorSettings, ServerConfig, WorkerSettings, write_config
from mcp_saga.schemas.keys import Keys
from mcp_saga.schemas.results import result_text
from mcp_saga.schemas.timeline import TimelineEntry
from rich.console import Console
from rich.table import Table

import mcp_saga

SCENARIO = [
    ("inventory", "reserve_inventory", {"sku": "SKU-42", "quantity": 3}),
    ("payments", "charge_payment", {"orderId": "order-42", "amount": 59.97}),
    ("shipping", "create_shipment", {"orderId": "order-42", "address": "1 Main St", "simulateFailure": True}),
]
SERVERS = ("inventory", "payments", "shipping")


class DemoFailed(Exception):
    pass


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("demo", help="run SEP-3172's reference scenario: baseline vs mcp-saga")
    p.add_argument("--redis", help="Redis URL (default: $REDIS_URL, else an embedded server)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (ledgers, logs)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the unwind")
    p.set_defaults(run=run)

    p = sub.add_parser("scenario", help="run the reference scenario's orchestrator against the configured servers")
    common(p)
    p.add_argument("--workflow", default=None, help="workflow id (default: order-<time>)")
    p.add_argument("--succeed", action="store_true", help="let the last step succeed (no unwind)")
    p.set_defaults(run=run_scenario)


def run_scenario(args: argparse.Namespace) -> int:
    """The demo's orchestrator alone: for compose, or a coordinator and workers you run yourself."""
    from mcp_saga.cli.args import CliError, config_of, redis_url

    config = config_of(args)
    missing = [name for name in SERVERS if name not in config.servers or not config.servers[name].url]
    if missing:
        raise CliError(f"the config must name HTTP servers {', '.join(missing)} (see deploy/saga.toml)")
    urls = {name: config.servers[name].url or "" for name in SERVERS}
    demo = Demo(redis_url(args), Path(tempfile.gettempdir()), Console(), 0)
    demo.workflow = args.workflow or demo.workflow
    demo.config = config  # a cluster's, say: the SDK connects and routes as the config says
    steps = [
        (s, t, {**a, "simulateFailure": False} if args.succeed and t == "create_shipment" else a)
        for s, t, a in SCENARIO
    ]
    outcome = asyncio.run(demo._through_saga(urls, steps, expect_failure=not args.succeed))
    demo.console.print(f"{demo.workflow}: {outcome}; follow it with `saga inspect {demo.workflow}`")
    return 0


def run(args: argparse.Namespace) -> int:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="saga-demo-"))
    try:
        with resolve_redis(args.redis) as url:
            return Demo(url, workdir, console, args.timeout).run()
    except DemoFailed as exc:
        console.print(f"[bold red]demo failed:[/] {exc}")
        console.print(f"logs: {workdir}")
        return 1
    finally:
        if not args.keep and not os.environ.get("SAGA_DEMO_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            console.print(f"kept {workdir}")


class Demo:
    def __init__(self, redis_url: str, workdir: Path, console: Console, timeout: float) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.console = console
        self.timeout = timeout
        self.workflow = f"order-42-{int(time.time())}"
        self.keys = Keys()
        self.config: Config | None = None

    def run(self) -> int:
        from mcp_saga.cli.procs import start_http_servers

        baseline_dbs = {name: self.workdir / f"baseline-{name}.db" for name in SERVERS}
        saga_dbs = {name: self.workdir / f"saga-{name}.db" for name in SERVERS}
        status = self.console.status("starting the example MCP servers (streamable HTTP)")
        with status, contextlib.ExitStack() as stack:
            specs = [
                (f"mcp_saga.examples.{n}", "--db", str(db)) for dbs in (baseline_dbs, saga_dbs) for n, db in dbs.items()
            ]
            started = stack.enter_context(start_http_servers(*specs))
            urls = [url for _, url in started]
            baseline_urls = dict(zip(SERVERS, urls[:3], strict=True))
            saga_urls = dict(zip(SERVERS, urls[3:], strict=True))

            status.update("run 1/2: baseline orchestrator (today's ToolAnnotations only)")
            baseline_error = asyncio.run(baseline(baseline_urls))
            self.console.print(f"[bold]baseline[/]: workflow aborted: {baseline_error}; nothing undone")

            status.update("run 2/2: starting a coordinator and a worker")
            config = self._config(saga_urls)
            stack.enter_context(self._saga_processes(config))
            status.update("run 2/2: the same workflow through mcp-saga")
            saga_error = asyncio.run(self._through_saga(saga_urls))
            self.console.print(f"[bold]mcp-saga[/]: workflow {saga_error}; unwinding")
            final = self._wait_unwound(status)

        baseline_state = {name: _summary(db) for name, db in baseline_dbs.items()}
        saga_state = {name: _summary(db) for name, db in saga_dbs.items()}
        self._show(baseline_state, saga_state)
        consistent = final == "compensated" and all(not _active(s) for s in saga_state.values())
        leftovers = any(_active(s) for s in baseline_state.values())
        if consistent and leftovers:
            self.console.print(
                "[bold green]consistent:[/] the baseline left its side effects in place; "
                "mcp-saga undid them in reverse order, from the servers' own SEP-3172 declarations."
            )
            return 0
        raise DemoFailed(f"mcp-saga run ended {final!r} with state {saga_state}")

    def _config(self, urls: dict[str, str]) -> Path:
        config = Config(
            servers={name: ServerConfig(url=url, timeout=10) for name, url in urls.items()},
            coordinator=CoordinatorSettings(block_ms=200),
            worker=WorkerSettings(attempts=3, backoff_base=0.5, backoff_max=2),
        )
        return write_config(config, self.workdir / "saga.toml")

    @contextlib.contextmanager
    def _saga_processes(self, config: Path) -> Iterator[None]:
        from mcp_saga.cli.procs import saga_process, stop_all

        procs = [
            saga_process("coordinator", redis_url=self.redis_url, config=config, log=self.workdir / "coordinator.log"),
            saga_process("worker", redis_url=self.redis_url, config=config, log=self.workdir / "worker.log"),
        ]
        try:
            yield
        finally:
            stop_all(*procs, grace=10)

    async def _through_saga(
        self,
        urls: dict[str, str],
        scenario: list[tuple[str, str, dict[str, Any]]] = SCENARIO,
        expect_failure: bool = True,
    ) -> str:
        from mcp import Client

        async with contextlib.AsyncExitStack() as stack:
            clients = {name: await stack.enter_async_context(Client(url)) for name, url in urls.items()}
            try:
                async with mcp_saga.workflow(
                    self.workflow, redis=self.redis_url, servers=clients, config=self.config
                ) as wf:
                    for server, tool, arguments in scenario:
                        await wf.call(server, tool, arguments)
                        self.console.print(f"  {server}:{tool} done, published step-completed")
            except Exception as exc:  # the failing step: the SDK has published workflow-failed
                return f"failed: {exc}"
        if expect_failure:
            raise DemoFailed("the scenario's last step was supposed to fail")
        return "completed"

    def _wait_unwound(self, status: Any) -> str:
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + self.timeout
        state = ""
        while time.monotonic() < deadline:
            raw = client.hgetall(self.keys.state(self.workflow))
            state = raw.get(b"status", b"").decode()
            comps = client.hvals(self.keys.comp(self.workflow))
            done = sum(b'"succeeded"' in c for c in comps)
            status.update(f"run 2/2: unwinding ({state or 'waiting for the coordinator'}; {done} compensated)")
            if state in ("compensated", "needs-attention"):
                return state
            time.sleep(0.1)
        raise DemoFailed(f"not unwound after {self.timeout:g}s (status {state!r}); see {self.workdir}")

    def _show(self, baseline_state: dict[str, dict], saga_state: dict[str, dict]) -> None:
        table = Table(title="final state of each server")
        table.add_column("server")
        table.add_column("baseline (today's annotations)")
        table.add_column("mcp-saga (SEP-3172 recovery)")
        for name in SERVERS:
            table.add_row(name, _describe(baseline_state[name]), _describe(saga_state[name]))
        self.console.print(table)

        timeline = Table(title=f"mcp-saga timeline of {self.workflow} (XRANGE {self.keys.log(self.workflow)})")
        for column in ("time", "event", "step", "detail"):
            timeline.add_column(column)
        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        start = None
        for _, fields in client.xrange(self.keys.log(self.workflow)):
            entry = TimelineEntry.from_fields(fields)
            start = start or entry.at
            detail = ", ".join(f"{k}={v}" for k, v in entry.details().items() if k not in ("key", "digest"))
            timeline.add_row(f"+{(entry.at - start) * 1000:.0f} ms", entry.type, entry.step or "", detail)
        self.console.print(timeline)


async def baseline(urls: dict[str, str]) -> str:
    """Today's orchestrator: it sees readOnly/destructive/idempotent hints, and no way to undo."""
    from mcp import Client

    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(Client(url)) for name, url in urls.items()}
        for server, tool, arguments in SCENARIO:
            result = await clients[server].call_tool(tool, arguments)
            if result.is_error:
                return result_text(result)
    raise DemoFailed("the scenario's last step was supposed to fail")


def _summary(db: Path) -> dict[str, dict[str, int]]:
    from mcp_saga.examples.ledger import read_state

    return read_state(db)["summary"] if db.exists() else {}


ACTIVE = {"active", "charged", "created"}


def _active(summary: dict[str, dict[str, int]]) -> bool:
    return any(status in ACTIVE for statuses in summary.values() for status in statuses)


def _describe(summary: dict[str, dict[str, int]]) -> str:
    if not summary:
        return "nothing"
    parts = []
    for kind, statuses in summary.items():
        for status, count in statuses.items():
            style = "red" if status in ACTIVE else "green"
            parts.append(f"[{style}]{count} {kind} {status}[/]")
    return ", ".join(parts)
