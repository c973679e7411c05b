"""The worker's pure decisions: trust checks (SEP-3172 section 8), attempt numbers, error classes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from mcp_saga.runtime.recovery_wire import ToolDeclaration, compensation, declaration_from_wire
from mcp_saga.schemas.config import Config, parse_config
from mcp_saga.schemas.records import Compensation, CompensationJob, idempotency_key
from mcp_saga.workers.job import _PERMANENT, attempt_of
from mcp_saga.workers.trust import Refusal, check, check_request

WF, STEP = "order-42", "charge"
REFUND = compensation("refund_payment", transactionId="$response.body#/transactionId")


def config(**policy: list[str]) -> Config:
    return parse_config(
        {
            "servers": {
                "payments": {"url": "http://127.0.0.1:1/mcp"},
                "legacy": {
                    "command": ["legacy-server"],
                    "recovery": {"charge": compensation("refund", id="$response.body#/id")},
                },
            },
            "policy": policy or {"auto": ["*"]},
        }
    )


def record(**changes: Any) -> Compensation:
    base = Compensation(
        step=STEP,
        seq=1,
        server="payments",
        tool="charge_payment",
        status="queued",
        operation_id="refund_payment",
        arguments={"transactionId": "TXN-1"},
        idempotency_key=idempotency_key(WF, STEP, "refund_payment"),
        source="server",
        dispatch=1,
    )
    return msgspec.structs.replace(base, **changes)


def job_for(rec: Compensation, **changes: Any) -> CompensationJob:
    job = CompensationJob(
        workflow=WF,
        step=rec.step,
        server=rec.server,
        tool=rec.tool,
        operation_id=rec.operation_id or "",
        arguments=rec.arguments or {},
        idempotency_key=rec.idempotency_key or "",
        dispatch=rec.dispatch,
        source=rec.source or "server",
    )
    return msgspec.structs.replace(job, **changes)


def tools(*entries: dict[str, Any]) -> dict[str, ToolDeclaration]:
    declarations = [declaration_from_wire(entry) for entry in entries]
    return {d.name: d for d in declarations if d is not None}


def tool(name: str, recovery: dict[str, Any] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "inputSchema": {"type": "object"}}
    if recovery is not None:
        entry["annotations"] = {"recovery": recovery}
    return entry


LIVE = tools(tool("charge_payment", REFUND), tool("refund_payment"))


def test_a_well_formed_compensation_passes() -> None:
    rec = record()
    assert check(job_for(rec), rec, config(), LIVE) is None


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        ("http://evil.example/mcp", "looks like an address"),
        ("payments:8001", "looks like an address"),
        ("billing", "not in this worker's registry"),
    ],
)
def test_servers_come_from_the_registry_only(server: str, reason: str) -> None:
    rec = record(server=server)
    refusal = check(job_for(rec), rec, config(), LIVE)
    assert refusal is not None and refusal.status == "unrecoverable" and reason in refusal.reason


def test_the_job_must_match_the_planned_record() -> None:
    rec = record()
    for changes, reason in [
        ({"server": "legacy"}, "ran on 'payments'"),
        ({"operation_id": "delete_everything"}, "the plan says 'refund_payment'"),
        ({"idempotency_key": "saga:other"}, "different idempotency key"),
    ]:
        refusal = check_request(job_for(rec, **changes), rec, config())
        assert refusal is not None and reason in refusal.reason, changes


def test_the_operation_must_be_listed_live() -> None:
    rec = record()
    refusal = check(job_for(rec), rec, config(), tools(tool("charge_payment", REFUND)))
    assert refusal == Refusal("unrecoverable", "payments does not list 'refund_payment' in tools/list")


def test_a_compensation_that_calls_the_original_tool_again_is_refused() -> None:
    rec = record(operation_id="charge_payment", idempotency_key="k")
    live = tools(tool("charge_payment", compensation("charge_payment", orderId="x")))
    refusal = check(job_for(rec), rec, config(), live)
    assert refusal is not None and "itself again" in refusal.reason


@pytest.mark.parametrize(
    ("original", "reason"),
    [
        (tool("charge_payment", compensation("void_payment", id="$response.body#/id")), "names 'void_payment' now"),
        (tool("charge_payment"), "no compensation is declared any more"),
        (tool("charge_payment", {"strategy": "manual"}), "not supported"),
    ],
)
def test_the_original_tool_must_still_declare_this_compensation(original: dict[str, Any], reason: str) -> None:
    rec = record()
    refusal = check(job_for(rec), rec, config(), tools(original, tool("refund_payment")))
    assert refusal is not None and refusal.status == "unrecoverable" and reason in refusal.reason


def test_an_original_tool_gone_from_the_listing_is_refused() -> None:
    rec = record()
    refusal = check(job_for(rec), rec, config(), tools(tool("refund_payment")))
    assert refusal is not None and "no longer lists 'charge_payment'" in refusal.reason


def test_an_overlay_compensation_is_confirmed_against_the_config_not_the_server() -> None:
    rec = record(server="legacy", tool="charge", operation_id="refund", source="overlay", idempotency_key="k")
    live = tools(tool("charge"), tool("refund"))  # the server declares nothing itself
    assert check(job_for(rec), rec, config(), live) is None
    other = record(server="legacy", tool="charge", operation_id="wipe", source="overlay", idempotency_key="k")
    refusal = check(job_for(other), other, config(), tools(tool("charge"), tool("wipe")))
    assert refusal is not None and "recovery overlay" in refusal.reason and "names 'refund'" in refusal.reason


def test_policy_deny_approval_and_auto() -> None:
    rec = record()
    job = job_for(rec)
    denied = check(job, rec, config(deny=["payments:*"]), LIVE)
    assert denied == Refusal("unrecoverable", "policy denies payments:refund_payment")
    waiting = check(job, rec, config(approval=["payments:refund_*"], auto=["*"]), LIVE)
    assert waiting == Refusal("awaiting-approval", "policy requires approval for payments:refund_payment")
    approved = record(approved=True)
    assert check(job_for(approved), approved, config(approval=["payments:refund_*"]), LIVE) is None
    assert check(job, rec, config(auto=["payments:refund_payment"]), LIVE) is None
    assert check(job, rec, config(auto=["inventory:*"]), LIVE) is not None  # unnamed pairs wait


def test_policy_needs_no_listing() -> None:
    """Deny and approval are decided before the server is asked anything."""
    rec = record()
    assert check_request(job_for(rec), rec, config(deny=["*"])) is not None


class _RQJob:
    def __init__(self, retries_left: int | None, intervals: list[int] | None):
        self.retries_left, self.retry_intervals = retries_left, intervals


@pytest.mark.parametrize(
    ("retries_left", "intervals", "expected"),
    [
        (4, [0, 0, 0, 0], (1, 4)),  # first of five attempts
        (1, [0, 0, 0, 0], (4, 1)),
        (0, [0, 0, 0, 0], (5, 0)),  # RQ stores 0 after the last retry: the final attempt
        (None, None, (1, 0)),  # enqueued without Retry: one attempt
        (2, [5], (3, 2)),  # foreign job with one interval: the config's 5 attempts fill in
    ],
)
def test_attempt_numbers_come_from_rq(retries_left: int | None, intervals: list[int] | None, expected: tuple) -> None:
    assert attempt_of(_RQJob(retries_left, intervals), config().worker) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "permanent"),
    [
        ("Unknown tool: refund_paymnt", True),
        ("Error executing tool refund_payment: 1 validation error for refund_paymentArguments\n...", True),
        ("Error executing tool add: 2 validation errors for addArguments\n...", True),
        ("Error executing tool refund_payment: transient failure injected: retry", False),
        ("unknown charge 'TXN-1'", False),
    ],
)
def test_sdk_error_texts_for_unknown_tools_and_invalid_arguments_are_permanent(text: str, permanent: bool) -> None:
    assert bool(_PERMANENT.match(text)) is permanent
