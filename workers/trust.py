"""The trust checks of SEP-3172 section 8, as pure functions a test can call without I/O.

A compensation is an automatic, possibly destructive call chosen from metadata a server
published and an event an orchestrator wrote, so nothing in the job is taken on faith: the
server must be one this worker was configured with, the call goes to the server the original
step ran on, and the server must still, right now, list the operation and declare it as the
undo of that step's tool, binding from that step exactly the arguments about to be sent (an event
may carry any declaration it likes, e.g. the server's own operation aimed at someone else's
charge). The policy then decides whether a human has to say yes first.

`check_request` needs only the job, the stored record and the config, so a refusal it finds
never costs a connection; `check_live` needs the server's current `tools/list`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from mcp_saga.runtime.recovery_wire import ToolDeclaration
from mcp_saga.schemas.config import Config
from mcp_saga.schemas.events import StepCompleted
from mcp_saga.schemas.expressions import UnresolvableError, resolve_parameters
from mcp_saga.schemas.records import Compensation, CompensationJob
from mcp_saga.schemas.recovery import Recovery


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a compensation will not run (yet): the step's next status and the operator's reason."""

    status: Literal["awaiting-approval", "unrecoverable"]
    reason: str


def _refuse(reason: str) -> Refusal:
    return Refusal("unrecoverable", reason)


def check_request(job: CompensationJob, record: Compensation, config: Config) -> Refusal | None:
    """Registry, job-against-record and policy checks: everything that needs no server."""
    server, operation = job.server, job.operation_id
    if ":" in server or "/" in server:
        return _refuse(f"server {server[:200]!r} looks like an address; workers call servers by registry name only")
    if server not in config.servers:
        return _refuse(f"server {server!r} is not in this worker's registry")
    if server != record.server:
        return _refuse(f"job targets server {server!r}, but step {record.step!r} ran on {record.server!r}")
    if job.kind == "recall":
        return _recall_request(job, record, config)
    if job.kind == "declaration":
        return _declaration_request(job, record)
    if record.kind != "compensation":
        return _refuse(f"job is a compensation, but the record of step {record.step!r} plans a {record.kind}")
    if operation != record.operation_id:
        return _refuse(f"job names operation {operation!r}, but the plan says {record.operation_id!r}")
    if job.idempotency_key != record.idempotency_key:
        return _refuse("job carries a different idempotency key than the plan")
    if (why := config.policy.self_inverse_refusal(server, record.tool, operation, record.source)) is not None:
        return _refuse(why)
    decision = config.policy.decide(server, operation)
    if decision == "deny":
        return _refuse(f"policy denies {server}:{operation}")
    if decision == "approval" and not record.approved:
        return Refusal("awaiting-approval", f"policy requires approval for {server}:{operation}")
    return None


def _recall_request(job: CompensationJob, record: Compensation, config: Config) -> Refusal | None:
    """A recall is the one call of a step's own tool a worker makes: with the forward key of the
    recorded intent, to learn what that call did. Anything else aimed at the original tool is refused."""
    server, tool = job.server, job.operation_id
    if record.kind != "recall" or record.forward_key is None:
        return _refuse(f"job re-calls {tool!r}, but step {record.step!r} plans no recall")
    if tool != record.tool:
        return _refuse(f"a recall calls the step's own tool {record.tool!r}, not {tool!r}")
    if job.idempotency_key != record.forward_key:
        return _refuse("recall carries another key than the forward key of the recorded call")
    if job.arguments != record.arguments:
        return _refuse("recall carries other arguments than the recorded call")
    decision = config.policy.decide(server, tool)
    if decision == "deny":
        return _refuse(f"policy denies {server}:{tool}")
    if decision == "approval" and not record.approved:
        return Refusal("awaiting-approval", f"policy requires approval for {server}:{tool} (a recall)")
    return None


def _declaration_request(job: CompensationJob, record: Compensation) -> Refusal | None:
    """A declaration job calls nothing: it lists the step's server (registry and server are checked
    above) for the declaration of the step's own tool, and only for a step that awaits one."""
    if record.kind != "declaration":
        return _refuse(f"job reads a live declaration, but the record of step {record.step!r} plans a {record.kind}")
    if job.operation_id != record.tool:
        return _refuse(f"a declaration job reads the step's own tool {record.tool!r}, not {job.operation_id!r}")
    return None


def check_recall_live(
    job: CompensationJob, config: Config, tools: Mapping[str, ToolDeclaration], intent: Mapping | None
) -> Refusal | None:
    """The tool must still be listed and declared idempotent (by the server, or the operator's config),
    and the call must be the recorded one: its arguments and forward key, as the intent has them."""
    server, tool = job.server, job.operation_id
    declaration = tools.get(tool)
    if declaration is None:
        return _refuse(f"{server} no longer lists {tool!r}, so it cannot be called again to learn its result")
    if declaration.annotations.get("idempotentHint") is not True and not config.declared_idempotent(server, tool):
        return _refuse(
            f"{server}:{tool} is not declared idempotent (no idempotentHint: true in its tools/list entry, and not "
            f"in servers.{server}.idempotent of the config): calling it again could repeat its effect"
        )
    if intent is not None:
        if intent.get("step") != job.step or intent.get("forwardKey") != job.idempotency_key:
            return _refuse(f"the recorded intent at position {job.seq} is not step {job.step!r} with this forward key")
        if intent.get("arguments", {}) != job.arguments:
            return _refuse("recall carries other arguments than the recorded intent")
    return None


def check_live(
    job: CompensationJob,
    record: Compensation,
    config: Config,
    tools: Mapping[str, ToolDeclaration],
    step: StepCompleted | None = None,
) -> Refusal | None:
    """The server, as it is now, must list the operation and still declare it as the undo.

    `step` is the recorded step-completed event; with it, the declaration must also bind the
    job's arguments. The coordinator writes a record and its step in one script, so only records
    written by hand (the worker tests') come without one.
    """
    server, operation, tool = job.server, job.operation_id, record.tool
    if operation not in tools:
        return _refuse(f"{server} does not list {operation!r} in tools/list")
    if record.source == "overlay":
        recovery, where = config.overlay(server, tool), f"the config's recovery overlay for {server}:{tool}"
    else:
        declaration = tools.get(tool)
        if declaration is None:
            return _refuse(f"{server} no longer lists {tool!r}, so its declared compensation cannot be confirmed")
        recovery, where = declaration.parsed_recovery(), f"{server}:{tool}'s live recovery declaration"
        if declaration.problem and recovery is None:
            return _refuse(f"{server}:{tool}: {declaration.problem}")
    return _names(recovery, operation, where) or _binds(recovery, job, record, step, where)


def _names(recovery: Recovery | None, operation: str, where: str) -> Refusal | None:
    if recovery is None:
        return _refuse(f"{where} is gone: no compensation is declared any more")
    if not recovery.supported:
        return _refuse(f"{where}: {recovery.unsupported_reason()}")
    declared = recovery.compensating_operation.operation_id  # type: ignore[union-attr]
    if declared != operation:
        return _refuse(f"{where} names {declared!r} now, not {operation!r}")
    return None


def _binds(
    recovery: Recovery | None, job: CompensationJob, record: Compensation, step: StepCompleted | None, where: str
) -> Refusal | None:
    """The arguments were resolved from the event's declaration; the live one must bind the same."""
    if step is None or recovery is None or recovery.compensating_operation is None:
        return None
    if step.step != record.step:
        return _refuse(f"the recorded step at position {record.seq} is {step.step!r}, not {record.step!r}")
    try:
        expected = resolve_parameters(
            recovery.compensating_operation.parameters, arguments=step.arguments, result=step.result
        )
    except UnresolvableError as exc:
        return _refuse(f"{where} cannot be resolved against the step: {exc}"[:2000])
    differ = sorted(
        name for name in expected.keys() | job.arguments.keys() if expected.get(name) != job.arguments.get(name)
    )
    if differ:
        names = ", ".join(repr(name[:100]) for name in differ[:10])
        return _refuse(f"{where} binds other arguments than the event's declaration did (differ: {names})")
    return None
