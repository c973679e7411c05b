from __future__ import annotations

from typing import Any

import pytest
import yaml
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery

# SEP-3172 section 4.2, verbatim.
SEP_EXAMPLE = """
recovery:
  strategy: compensation
  compensatingOperation:
    operationId: refund_payment
    parameters:
      transactionId: $response.body#/transactionId
"""


def sep_recovery() -> dict[str, Any]:
    return yaml.safe_load(SEP_EXAMPLE)["recovery"]


def test_the_sep_example_parses_and_is_supported() -> None:
    recovery = parse_recovery(sep_recovery())
    assert recovery.strategy == "compensation"
    assert recovery.compensating_operation is not None
    assert recovery.compensating_operation.operation_id == "refund_payment"
    assert recovery.compensating_operation.parameters == {"transactionId": "$response.body#/transactionId"}
    assert recovery.supported
    assert recovery.unsupported_reason() is None


def test_the_sep_example_dumps_back_to_its_wire_form() -> None:
    assert parse_recovery(sep_recovery()).to_wire() == sep_recovery()


def test_constants_and_templates_are_valid_bindings() -> None:
    data = sep_recovery()
    data["compensatingOperation"]["parameters"] |= {"reason": "undo {$request.body#/orderId}", "notify": False}
    assert parse_recovery(data).compensating_operation.parameters["notify"] is False


def test_an_unknown_strategy_is_kept_and_reported_unsupported() -> None:
    recovery = parse_recovery({"strategy": "retry-elsewhere", "compensatingOperation": {"operationId": "x"}})
    assert recovery.strategy == "retry-elsewhere"
    assert not recovery.supported
    assert recovery.unsupported_reason() == "recovery strategy 'retry-elsewhere' is not supported (only 'compensation')"


def test_an_unknown_strategy_needs_no_compensating_operation() -> None:
    recovery = parse_recovery({"strategy": "manual-only", "runbook": "https://example.com/undo"})
    assert "'manual-only' is not supported" in (recovery.unsupported_reason() or "")
    assert recovery.to_wire() == {"strategy": "manual-only", "runbook": "https://example.com/undo"}


def test_compensation_without_an_operation_is_unsupported() -> None:
    recovery = parse_recovery({"strategy": "compensation"})
    assert not recovery.supported
    assert recovery.unsupported_reason() == "recovery strategy 'compensation' without a compensatingOperation"


@pytest.mark.parametrize("operation_id", ["refund payment", "", "a/b", "x" * 129])
def test_a_bad_operation_id_names_the_field_and_the_value(operation_id: str) -> None:
    data = sep_recovery()
    data["compensatingOperation"]["operationId"] = operation_id
    with pytest.raises(RecoveryError) as caught:
        parse_recovery(data)
    message = str(caught.value)
    assert message.startswith("recovery.compensatingOperation.operationId: ")
    assert f"(got {operation_id!r})" in message


@pytest.mark.parametrize(
    ("binding", "why"),
    [
        ("$url", "MCP tool calls have no URL"),
        ("$request.header.Authorization", "MCP requests have no headers"),
        ("$response.body.transactionId", "a body pointer follows '#'"),
        ("txn {$response.body#/id", "no closing '}'"),
    ],
)
def test_a_bad_binding_names_the_field_the_parameter_and_the_expression(binding: str, why: str) -> None:
    data = sep_recovery()
    data["compensatingOperation"]["parameters"]["transactionId"] = binding
    with pytest.raises(RecoveryError) as caught:
        parse_recovery(data)
    message = str(caught.value)
    assert message.startswith("recovery.compensatingOperation.parameters: parameter 'transactionId': `")
    assert binding in message
    assert why in message


def test_a_missing_strategy_names_the_field() -> None:
    with pytest.raises(RecoveryError, match=r"^recovery\.strategy: Field required"):
        parse_recovery({"compensatingOperation": {"operationId": "refund_payment"}})


def test_errors_are_prefixed_with_where_the_declaration_came_from() -> None:
    with pytest.raises(RecoveryError, match=r"^annotations\.recovery\.strategy: "):
        parse_recovery({"strategy": 3}, where="annotations.recovery")


def test_a_parsed_recovery_is_returned_as_is() -> None:
    recovery = parse_recovery(sep_recovery())
    assert parse_recovery(recovery) is recovery
    assert isinstance(recovery, Recovery)
