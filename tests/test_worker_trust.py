"""The worker's pure decisions: trust checks (SEP-3172 section 8), attempt numbers, error classes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from mcp_saga.runtime.recovery_wire import ToolDeclaration, compensation, declaration_from_wire
from mcp_saga.schemas.config import Config, ConfigError, parse_config
from mcp_saga.schemas.records import Compensation, CompensationJob, forward_key, idempotency_key
from mcp_saga.workers.job import _PERMANENT, attempt_of
from mcp_saga.workers.trust import Refusal, check_live, check_recall_live, check_request

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


def check(job: CompensationJob, rec: Compensation, cfg: Config, live: dict[str, ToolDeclaration]) -> Refusal | None:
    """Both halves, as the worker runs them: the request first, then against the live listing."""
    return check_request(job, rec, cfg) or check_live(job, rec, cfg, live)


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
    assert refusal is not None and "would call the original tool 'charge_payment' again" in refusal.reason
    assert 'self_inverse = ["payments:charge_payment"]' in refusal.reason  # says how to allow it


MOVE = compensation("move_file", source="$request.body#/destination", destination="$request.body#/source")


def move_record(source: str) -> Compensation:
    return record(
        server="fs", tool="move_file", operation_id="move_file", source=source, idempotency_key="k",
        arguments={"source": "b", "destination": "a"},
    )  # fmt: skip


def fs_config(**policy: list[str]) -> Config:
    overlay = {"recovery": {"move_file": MOVE}}
    return parse_config({"servers": {"fs": {"command": ["fs-server"], **overlay}}, "policy": {"auto": ["*"], **policy}})


def test_a_self_inverse_declared_by_an_operator_overlay_is_trusted() -> None:
    rec = move_record("overlay")
    assert check(job_for(rec), rec, fs_config(), tools(tool("move_file"))) is None


def test_a_self_inverse_declared_by_the_server_needs_the_policys_consent() -> None:
    rec = move_record("server")
    live = tools(tool("move_file", MOVE))
    refusal = check(job_for(rec), rec, fs_config(), live)
    assert refusal is not None and refusal.status == "unrecoverable" and "self_inverse" in refusal.reason
    assert check(job_for(rec), rec, fs_config(self_inverse=["fs:move_file"]), live) is None
    assert check(job_for(rec), rec, fs_config(self_inverse=["fs:*"]), live) is None
    assert check(job_for(rec), rec, fs_config(self_inverse=["other:move_file"]), live) is not None


def test_a_config_that_could_only_be_refused_fails_at_start_up_naming_the_field() -> None:
    never = {"strategy": "compensation"}
    with pytest.raises(ConfigError) as refused:
        parse_config({"servers": {"fs": {"command": ["fs-server"], "recovery": {"move_file": never}}}})
    assert str(refused.value) == (
        "config: servers.fs.recovery.move_file.compensatingOperation: recovery strategy 'compensation' without a"
        " compensatingOperation: this overlay could never run"
    )
    with pytest.raises(ConfigError, match=r"policy\.self_inverse\.0: 'move_file' is not a server:tool pattern"):
        parse_config({"policy": {"self_inverse": ["move_file"]}})
    assert fs_config(deny=["*"]).policy.deny == ["*"]  # the emergency brake still starts


def test_policy_needs_no_listing() -> None:
    """Deny and approval are decided before the server is asked anything."""
    rec = record()
    assert check_request(job_for(rec), rec, config(deny=["*"])) is not None


class _RQJob:
    def __init__(self, retries_left: int | None, intervals: list[int] | None, first: int | None = None):
        self.retries_left, self.retry_intervals = retries_left, intervals
        self.meta = {} if first is None else {"first_attempt": first}


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
    ("retries_left", "intervals", "expected"),
    [
        (2, [0, 0], (3, 2)),  # deferred at its third attempt: the continuation starts there
        (1, [0, 0], (4, 1)),
        (0, [0, 0], (5, 0)),
        (None, None, (3, 0)),  # deferred at its last attempt: continued without Retry
    ],
)
def test_a_deferred_jobs_continuation_goes_on_counting_where_it_stopped(
    retries_left: int | None, intervals: list[int] | None, expected: tuple
) -> None:
    assert attempt_of(_RQJob(retries_left, intervals, first=3), config().worker) == expected  # type: ignore[arg-type]


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


# Recalls: the one call of a step's own tool a worker makes (issue 14).

FORWARD = forward_key(WF, STEP)
ORDER = {"orderId": "o-1", "amount": 5}


def recall_record(**changes: Any) -> Compensation:
    base = record(kind="recall", operation_id="charge_payment", arguments=ORDER, idempotency_key=FORWARD)
    return msgspec.structs.replace(base, forward_key=FORWARD, **changes)


def idempotent_charge(hint: bool = True) -> dict[str, Any]:
    return {**tool("charge_payment", REFUND), "annotations": {"idempotentHint": hint, "recovery": REFUND}}


INTENT = {"step": STEP, "forwardKey": FORWARD, "arguments": ORDER}


def test_a_recall_of_the_recorded_call_passes_both_checks() -> None:
    rec = recall_record()
    job = job_for(rec, kind="recall")
    assert check_request(job, rec, config()) is None
    assert check_recall_live(job, config(), tools(idempotent_charge()), INTENT) is None


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"operation_id": "refund_payment"}, "a recall calls the step's own tool"),
        ({"idempotency_key": "saga:fwd:other"}, "another key than the forward key"),
        ({"arguments": {"orderId": "o-1", "amount": 500}}, "other arguments than the recorded call"),
        ({"server": "legacy"}, "ran on 'payments'"),
    ],
)
def test_a_recall_that_is_not_exactly_the_recorded_call_is_refused(changes: dict[str, Any], why: str) -> None:
    rec = recall_record()
    refusal = check_request(job_for(rec, kind="recall", **changes), rec, config())
    assert refusal is not None and why in refusal.reason


def test_a_recall_job_for_a_record_that_plans_none_is_refused() -> None:
    rec = record()  # a compensation's record: the original tool must never be called for it
    refusal = check_request(job_for(rec, kind="recall", operation_id="charge_payment"), rec, config())
    assert refusal is not None and "plans no recall" in refusal.reason


def test_a_recall_needs_the_tool_declared_idempotent_live_or_by_the_operator() -> None:
    job = job_for(recall_record(), kind="recall")
    refusal = check_recall_live(job, config(), tools(idempotent_charge(False)), INTENT)
    assert refusal is not None and "not declared idempotent" in refusal.reason
    operator = parse_config({"servers": {"payments": {"url": "http://x/mcp", "idempotent": ["charge_payment"]}}})
    assert check_recall_live(job, operator, tools(idempotent_charge(False)), INTENT) is None


def test_a_recall_must_match_the_intent_on_the_stack() -> None:
    job = job_for(recall_record(), kind="recall")
    refusal = check_recall_live(job, config(), tools(idempotent_charge()), {**INTENT, "arguments": {}})
    assert refusal is not None and "other arguments than the recorded intent" in refusal.reason


def declaration_record(**changes: Any) -> Compensation:
    key = idempotency_key(WF, STEP, "tools/list")
    return record(kind="declaration", operation_id="charge_payment", idempotency_key=key, source=None, **changes)


def test_a_declaration_job_for_a_step_awaiting_one_passes_the_request_checks() -> None:
    rec = declaration_record()
    assert check_request(job_for(rec, kind="declaration"), rec, config()) is None


@pytest.mark.parametrize(
    ("rec", "changes", "why"),
    [
        (record(), {"kind": "declaration"}, "job reads a live declaration, but the record of step 'charge' plans a"),
        (declaration_record(), {"kind": "declaration", "operation_id": "refund_payment"}, "the step's own tool"),
        (declaration_record(), {"kind": "declaration", "server": "stranger"}, "not in this worker's registry"),
        (declaration_record(), {"kind": "compensation"}, "plans a declaration"),
    ],
)
def test_a_declaration_job_that_does_not_match_its_record_is_refused(
    rec: Compensation, changes: dict[str, Any], why: str
) -> None:
    refusal = check_request(job_for(rec, **changes), rec, config())
    assert refusal is not None and refusal.status == "unrecoverable" and why in refusal.reason, refusal
