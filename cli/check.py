"""`saga check SERVER`: a live server's recovery declarations (and the config's overlays) against its schemas."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from mcp_saga.cli import render
from mcp_saga.cli.args import CliError, add_command, config_of


def cmd_check(args: argparse.Namespace) -> int:
    from mcp_saga.runtime.recovery_wire import ToolDeclaration
    from mcp_saga.runtime.sessions import SessionError, SessionPool
    from mcp_saga.schemas.check import Problem, ToolSchemas, check_declaration
    from mcp_saga.schemas.recovery import RecoveryError, parse_recovery

    config, name = config_of(args), args.server
    server = config.servers.get(name)
    if server is None:
        known = ", ".join(config.servers) or "none: pass --config FILE or set SAGA_CONFIG"
        raise CliError(f"no server {name!r} in the config (configured: {known})")
    # The pool logs each failed connect as "reconnecting"; here the one-line error below says it all.
    sessions_log = logging.getLogger("saga.sessions")
    level = sessions_log.level
    sessions_log.setLevel(logging.ERROR)
    try:
        with SessionPool({name: server}, tools_ttl=0) as pool:
            declared: dict[str, ToolDeclaration] = pool.tools(name)
    except SessionError as exc:
        raise CliError(f"cannot list the tools of {name!r}: {exc}") from None
    finally:
        sessions_log.setLevel(level)
    schemas = {tool: ToolSchemas(d.input_schema, d.output_schema) for tool, d in declared.items()}

    def wire(recovery: Any) -> dict[str, Any] | None:
        try:
            return parse_recovery(recovery).to_wire()
        except RecoveryError:
            return None

    checked: list[dict[str, Any]] = []
    for tool, d in sorted(declared.items()):
        if d.recovery is None:
            continue
        parsed = d.parsed_recovery()
        operation = parsed.compensating_operation if parsed is not None else None
        consented = operation is not None and not config.policy.self_inverse_refusal(
            name, tool, operation.operation_id, "server"
        )
        problems = check_declaration(tool, d.recovery, schemas, self_inverse=consented)
        if d.problem and d.parsed_recovery() is not None:  # an invalid one is already an error above
            problems.append(Problem(tool, "recovery", d.problem, "warning"))
        if tool in server.recovery and server.recovery[tool].to_wire() != wire(d.recovery):
            problems.append(Problem(tool, "recovery", "the config's overlay overrides this declaration", "warning"))
        checked.append(
            {"tool": tool, "source": f"server ({d.recovery_source})", "recovery": d.recovery, "problems": problems}
        )
    for tool, recovery in sorted(server.recovery.items()):
        checked.append(
            {
                "tool": tool,
                "source": "overlay",
                "recovery": recovery.to_wire(),
                "problems": check_declaration(tool, recovery, schemas, self_inverse=True),
            }
        )
    errors = sum(p.severity == "error" for c in checked for p in c["problems"])
    warnings = sum(p.severity == "warning" for c in checked for p in c["problems"])
    summary = (
        f"{name}: {len(declared)} tools listed, {len(checked)} recovery declaration(s) checked; "
        f"{errors} error(s), {warnings} warning(s)"
    )
    if args.json:
        for c in checked:
            c["problems"] = [msgspec.to_builtins(p) for p in c["problems"]]
        render.emit_json(
            {"server": name, "tools": sorted(declared), "checked": checked, "errors": errors, "warnings": warnings}
        )
        return 1 if errors else 0

    rows = []
    for c in checked:
        op = (c["recovery"].get("compensatingOperation") or {}) if isinstance(c["recovery"], dict) else {}
        operation = op.get("operationId") if isinstance(op, dict) else None
        if not c["problems"]:
            rows.append((c["tool"], c["source"], operation, "ok", "", ""))
        rows += [(c["tool"], c["source"], operation, p.severity, p.field, p.message) for p in c["problems"]]
    out = render.console()
    out.print(render.table(f"recovery declarations of {name!r}", "tool, source, undo, severity, field, problem", rows))
    out.print(summary, markup=False)
    return 1 if errors else 0


def register(sub: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    help = "check a configured server's recovery declarations against its live tools/list"
    p = add_command(sub, common, "check", cmd_check, help)
    p.add_argument("server", help="a server name from the config")
