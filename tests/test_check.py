from __future__ import annotations

from typing import Any

import pytest
from mcp_saga.schemas.check import Problem, ToolSchemas, check_declaration
from mcp_saga.schemas.recovery import parse_recovery

CHARGE_INPUT = {
    "type": "object",
    "properties": {"orderId": {"type": "string"}, "amount": {"type": "number"}, "card": {"$ref": "#/$defs/Card"}},
    "required": ["orderId", "amount"],
    "$defs": {"Card": {"type": "object", "properties": {"last4": {"type": "string"}}, "additionalProperties": False}},
}
CHARGE_OUTPUT = {
    "type": "object",
    "properties": {
        "transactionId": {"type": "string"},
        "amount": {"type": "number"},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/Line"}},
        "extra": {"type": "object"},
        "raw": {},
    },
    "required": ["transactionId"],
    "additionalProperties": False,
    "$defs": {"Line": {"type": "object", "properties": {"sku": {"type": "string"}}, "additionalProperties": False}},
}
REFUND_INPUT = {
    "type": "object",
    "properties": {
        "transactionId": {"type": "string"},
        "amount": {"type": "number"},
        "reason": {"type": "string"},
        "idempotencyKey": {"type": "string"},
    },
    "required": ["transactionId", "idempotencyKey"],
    "additionalProperties": False,
}
TOOLS = {
    "charge_payment": ToolSchemas(CHARGE_INPUT, CHARGE_OUTPUT),
    "refund_payment": ToolSchemas(REFUND_INPUT, {"type": "object"}),
    "create_shipment": ToolSchemas({"type": "object", "properties": {"orderId": {"type": "string"}}}, None),
}


def declaration(parameters: dict[str, Any], operation: str = "refund_payment") -> dict[str, Any]:
    return {"strategy": "compensation", "compensatingOperation": {"operationId": operation, "parameters": parameters}}


def check(parameters: dict[str, Any], *, tool: str = "charge_payment", **kwargs: Any) -> list[Problem]:
    return check_declaration(tool, declaration(parameters, **kwargs), TOOLS)


def only(problems: list[Problem]) -> Problem:
    assert len(problems) == 1, problems
    return problems[0]


def pointer_problem(schema: dict[str, Any], pointer: str) -> Problem | None:
    tools = {"t": ToolSchemas({"type": "object"}, schema), "undo": ToolSchemas({"type": "object"}, None)}
    problems = check_declaration("t", declaration({"x": f"$response.body#{pointer}"}, "undo"), tools)
    assert len(problems) <= 1, problems
    return problems[0] if problems else None


def test_the_sep_example_is_clean() -> None:
    assert check({"transactionId": "$response.body#/transactionId"}) == []


def test_a_full_declaration_using_every_source_is_clean() -> None:
    parameters = {
        "transactionId": "$response.body#/transactionId",
        "amount": "$request.body#/amount",
        "reason": "undo {$request.body#/orderId} line {$response.body#/lines/0/sku} {$response.header.traceId}",
    }
    assert check(parameters) == []


def test_a_parsed_recovery_is_accepted_as_well_as_a_dict() -> None:
    recovery = parse_recovery(declaration({"transactionId": "$response.body#/nope"}))
    problem = only(check_declaration("charge_payment", recovery, TOOLS))
    assert problem.field == "compensatingOperation.parameters.transactionId"


def test_an_operation_the_server_does_not_list_is_an_error() -> None:
    problems = check({"transactionId": "$response.body#/transactionId"}, operation="refund")
    assert problems == [
        Problem(
            "charge_payment",
            "compensatingOperation.operationId",
            "the server does not list a tool 'refund'",
            "error",
        )
    ]


def test_compensating_with_the_tool_itself_is_an_error() -> None:
    problems = check({"orderId": "$request.body#/orderId", "amount": -1}, operation="charge_payment")
    problem = only(problems)
    assert problem.field == "compensatingOperation.operationId"
    assert problem.message.startswith("names 'charge_payment' itself: compensating would call it again")


def test_a_self_inverse_the_operator_or_the_policy_allows_is_not_an_error() -> None:
    recovery = {
        "strategy": "compensation",
        "compensatingOperation": {
            "operationId": "move_file",
            "parameters": {"source": "$request.body#/destination", "destination": "$request.body#/source"},
        },
    }
    schema = {"type": "object", "properties": {"source": {"type": "string"}, "destination": {"type": "string"}}}
    tools = {"move_file": ToolSchemas(schema, None)}
    assert check_declaration("move_file", recovery, tools, self_inverse=True) == []
    [problem] = check_declaration("move_file", recovery, tools)
    assert "[policy] self_inverse" in problem.message


def test_an_unsupported_strategy_is_reported_and_nothing_else() -> None:
    recovery = {"strategy": "retry-elsewhere", "compensatingOperation": {"operationId": "nope"}}
    problem = only(check_declaration("charge_payment", recovery, TOOLS))
    assert (problem.field, problem.severity) == ("strategy", "error")
    assert "'retry-elsewhere' is not supported" in problem.message


def test_compensation_without_an_operation_is_reported() -> None:
    problem = only(check_declaration("charge_payment", {"strategy": "compensation"}, TOOLS))
    assert problem.field == "compensatingOperation"
    assert "without a compensatingOperation" in problem.message


def test_a_declaration_that_does_not_parse_is_one_error_naming_the_field() -> None:
    problem = only(check_declaration("charge_payment", declaration({"transactionId": "$url"}), TOOLS))
    assert problem.field == "recovery"
    assert "recovery.compensatingOperation.parameters" in problem.message
    assert "`$url`" in problem.message


def test_a_response_field_the_output_schema_rules_out_is_an_error() -> None:
    problem = only(check({"transactionId": "$response.body#/txnId"}))
    assert problem == Problem(
        "charge_payment",
        "compensatingOperation.parameters.transactionId",
        "`$response.body#/txnId`: outputSchema of 'charge_payment' has no property 'txnId'"
        " (additionalProperties is false) at /txnId",
        "error",
    )


def test_a_request_field_the_input_schema_rules_out_is_an_error() -> None:
    problems = check({"transactionId": "$response.body#/transactionId", "reason": "$request.body#/card/cvc"})
    problem = only(problems)
    assert problem.field == "compensatingOperation.parameters.reason"
    assert problem.message == (
        "`$request.body#/card/cvc`: inputSchema of 'charge_payment' has no property 'cvc'"
        " (additionalProperties is false) at /card/cvc"
    )


def test_template_parts_are_checked_too() -> None:
    problem = only(check({"transactionId": "$response.body#/transactionId", "reason": "x {$response.body#/why}"}))
    assert problem.field == "compensatingOperation.parameters.reason"
    assert "'why'" in problem.message


def test_header_bindings_are_not_checked_against_schemas() -> None:
    assert check({"transactionId": "$response.header.com.example/txn"}) == []


def test_a_missing_output_schema_is_a_warning_naming_the_bindings() -> None:
    tools = {"ship": ToolSchemas({"type": "object"}, None), "cancel": ToolSchemas(None, None)}
    recovery = declaration({"id": "$response.body#/id", "why": "{$response.body#/why}", "k": 1}, "cancel")
    problem = only(check_declaration("ship", recovery, tools))
    assert (problem.field, problem.severity) == ("compensatingOperation.parameters", "warning")
    assert "'ship' has no outputSchema" in problem.message
    assert "in id, why relies on its result being a single JSON text block" in problem.message


def test_an_unlisted_original_tool_is_a_warning() -> None:
    problem = only(check({"transactionId": "$response.body#/anything"}, tool="capture_payment"))
    assert (problem.field, problem.severity) == ("recovery", "warning")
    assert "'capture_payment' is not listed" in problem.message


def test_required_inputs_left_unbound_are_errors_except_the_idempotency_key() -> None:
    problems = check({"reason": "compensation"})
    assert problems == [
        Problem(
            "charge_payment",
            "compensatingOperation.parameters.transactionId",
            "required input of 'refund_payment' is not bound",
        )
    ]


def test_snake_case_idempotency_key_is_filled_by_the_worker_too() -> None:
    tools = {
        **TOOLS,
        "void": ToolSchemas(
            {"type": "object", "properties": {"id": {}, "idempotency_key": {}}, "required": ["id", "idempotency_key"]}
        ),
    }
    recovery = declaration({"id": "$response.body#/transactionId"}, "void")
    assert check_declaration("charge_payment", recovery, tools) == []


def test_a_bound_input_refused_by_additional_properties_false_says_so() -> None:
    problem = only(check({"transactionId": "$response.body#/transactionId", "txn": "$response.body#/amount"}))
    assert problem.field == "compensatingOperation.parameters.txn"
    assert problem.message == "'refund_payment' does not accept an input 'txn' (additionalProperties is false)"


def test_a_bound_input_missing_from_properties_is_an_error_that_says_so() -> None:
    tools = {**TOOLS, "create_shipment": ToolSchemas({"type": "object", "properties": {"orderId": {}}})}
    recovery = declaration({"orderId": "$request.body#/orderId", "order": "$request.body#/orderId"}, "create_shipment")
    problem = only(check_declaration("charge_payment", recovery, tools))
    assert problem.field == "compensatingOperation.parameters.order"
    assert problem.message == "'create_shipment' has no input 'order' in its inputSchema properties"


@pytest.mark.parametrize(
    "input_schema",
    [
        {"type": "object"},
        {"type": "object", "properties": {"orderId": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"orderId": {}}, "additionalProperties": {"type": "string"}},
        {
            "type": "object",
            "properties": {"orderId": {}},
            "patternProperties": {"^ord": {}},
            "additionalProperties": False,
        },
        {"anyOf": [{"properties": {"orderId": {}}, "additionalProperties": False}, {"properties": {"order": {}}}]},
    ],
)
def test_inputs_the_schema_accepts_are_not_reported(input_schema: dict[str, Any]) -> None:
    tools = {**TOOLS, "undo": ToolSchemas(input_schema)}
    recovery = declaration({"orderId": "$request.body#/orderId", "order": "$request.body#/orderId"}, "undo")
    assert check_declaration("charge_payment", recovery, tools) == []


def test_a_compensating_tool_without_input_schema_is_not_checked() -> None:
    tools = {**TOOLS, "undo": ToolSchemas(None, None)}
    assert check_declaration("charge_payment", declaration({"anything": 1}, "undo"), tools) == []


def test_problems_are_listed_together() -> None:
    problems = check({"txn": "$response.body#/id", "reason": "$request.body#/nope"})
    assert [(p.field, p.severity) for p in problems] == [
        ("compensatingOperation.parameters.txn", "error"),
        ("compensatingOperation.parameters.reason", "warning"),
        ("compensatingOperation.parameters.transactionId", "error"),
        ("compensatingOperation.parameters.txn", "error"),
    ]


def test_tool_schemas_from_a_tools_list_entry() -> None:
    entry = {"name": "charge_payment", "inputSchema": CHARGE_INPUT, "outputSchema": CHARGE_OUTPUT}
    assert ToolSchemas.from_wire(entry) == ToolSchemas(CHARGE_INPUT, CHARGE_OUTPUT)
    assert ToolSchemas.from_wire({"name": "x", "inputSchema": {}}) == ToolSchemas({}, None)


# The schema walk behind $response.body / $request.body pointers.

TREE = {
    "$ref": "#/$defs/Node",
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "additionalProperties": False,
        }
    },
}


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        (CHARGE_OUTPUT, ""),
        (CHARGE_OUTPUT, "/lines/0/sku"),
        (CHARGE_OUTPUT, "/lines/12"),
        (CHARGE_OUTPUT, "/extra/anything/at/all"),
        (CHARGE_OUTPUT, "/raw/0/x"),
        ({}, "/a/b/0"),
        ({"type": "object", "additionalProperties": {"type": "object", "properties": {"id": {}}}}, "/k/id"),
        ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False}, "/x-a"),
        ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "object"}], "items": False}, "/1/k"),
        ({"type": "array", "items": [{"type": "object", "properties": {"id": {}}}]}, "/0/id"),
        ({"type": ["object", "null"], "properties": {"id": {}}, "additionalProperties": False}, "/id"),
        ({"anyOf": [{"type": "string"}, {"type": "object", "properties": {"id": {}}}]}, "/id"),
        ({"oneOf": [{"type": "array"}, {"type": "object", "additionalProperties": False}]}, "/3"),
        ({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}, "/b"),
        ({"allOf": [{"required": ["a"]}, {"properties": {"a": {}}, "additionalProperties": False}]}, "/a"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "anyOf": [{"required": ["a"]}]}, "/a"),
        ({"anyOf": [{"required": ["a"]}, {"type": "string"}]}, "/a"),
        ({"$ref": "https://example.com/schema.json"}, "/whatever"),
        ({"$ref": "#/$defs/missing"}, "/whatever"),
        (TREE, "/children/0/children/3/name"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "/x"),
    ],
)
def test_pointers_the_schema_allows_are_not_reported(schema: dict[str, Any], pointer: str) -> None:
    assert pointer_problem(schema, pointer) is None


@pytest.mark.parametrize(
    ("schema", "pointer", "reason"),
    [
        (CHARGE_OUTPUT, "/lines/0/qty", "has no property 'qty' (additionalProperties is false) at /lines/0/qty"),
        (CHARGE_OUTPUT, "/lines/-", "expects an array index, not '-', at /lines/-"),
        (CHARGE_OUTPUT, "/lines/01", "expects an array index, not '01', at /lines/01"),
        (CHARGE_OUTPUT, "/amount/cents", "allows only number, which cannot hold 'cents', at /amount/cents"),
        (CHARGE_OUTPUT, "/transactionId/0", "allows only string, which cannot hold '0', at /transactionId/0"),
        ({"type": "array", "maxItems": 2}, "/2", "has at most 2 items, no index 2 at /2"),
        ({"type": "array", "prefixItems": [{}], "items": False}, "/1", "has no index 1 (only 1 items) at /1"),
        ({"type": "object", "properties": {"a": False}}, "/a", "allows nothing at /a"),
        (TREE, "/children/0/title", "has no property 'title' (additionalProperties is false) at /children/0/title"),
        (
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "object", "properties": {"id": {}}, "additionalProperties": False},
                ]
            },
            "/name",
            "allows only string, which cannot hold 'name', at /name",
        ),
        (
            {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "object", "additionalProperties": False}}},
            "/a",
            "has no property 'a' (additionalProperties is false) at /a",
        ),
    ],
)
def test_pointers_the_schema_rules_out_are_errors(schema: dict[str, Any], pointer: str, reason: str) -> None:
    problem = pointer_problem(schema, pointer)
    assert problem is not None
    assert problem.severity == "error"
    assert problem.message == f"`$response.body#{pointer}`: outputSchema of 't' {reason}"


@pytest.mark.parametrize(
    ("schema", "pointer", "at"),
    [
        ({"type": "object", "properties": {"id": {}}}, "/ID", "/ID"),
        ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}, "/a/c/d", "/a/c"),
        ({"type": "object", "patternProperties": {"^x-": {}}}, "/y", "/y"),
    ],
)
def test_undeclared_properties_of_an_open_schema_are_warnings(schema: dict[str, Any], pointer: str, at: str) -> None:
    problem = pointer_problem(schema, pointer)
    assert problem is not None
    assert problem.severity == "warning"
    assert problem.message.endswith(f"does not declare a property {at.rsplit('/', 1)[1]!r} at {at}")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": 5, "properties": [], "patternProperties": "x", "anyOf": {}, "prefixItems": 3, "required": 1},
        {"type": "object", "patternProperties": {"(": {}}, "additionalProperties": False},
        {"type": "array", "items": [], "maxItems": "two"},
    ],
)
def test_malformed_schemas_from_a_server_do_not_crash_the_check(schema: dict[str, Any]) -> None:
    tools = {"t": ToolSchemas(schema, schema), "undo": ToolSchemas(schema, None)}
    problems = check_declaration("t", declaration({"x": "$response.body#/0/y", "y": "$request.body#/a"}, "undo"), tools)
    assert all(isinstance(problem, Problem) for problem in problems)


# Types of bindings against the compensating tool's inputs

CREATE_OUTPUT = {
    "type": "object",
    "properties": {
        "entities": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "entityType": {"type": "string"}}},
        }
    },
}
DELETE_INPUT = {
    "type": "object",
    "properties": {"entityNames": {"type": "array", "items": {"type": "string"}}},
    "required": ["entityNames"],
}
MEMORY = {
    "create_entities": ToolSchemas({"type": "object"}, CREATE_OUTPUT),
    "delete_entities": ToolSchemas(DELETE_INPUT),
}


def memory_recovery(binding: Any) -> dict[str, Any]:
    return {
        "strategy": "compensation",
        "compensatingOperation": {"operationId": "delete_entities", "parameters": {"entityNames": binding}},
    }


def memory_problems(binding: Any) -> list[Problem]:
    return check_declaration("create_entities", memory_recovery(binding), MEMORY)


@pytest.mark.parametrize(
    "binding",
    ["$response.body#/entities/*/name", ["$response.body#/entities/0/name"], ["fixed"], "$response.body#/entities"],
)
def test_bindings_that_yield_an_array_match_an_array_input(binding: Any) -> None:
    assert memory_problems(binding) == []


@pytest.mark.parametrize(
    ("binding", "yields"),
    [
        ("$response.body#/entities/0/name", "a string"),
        ("{$response.body#/entities/0/name}", "a string"),
        ({"name": "$response.body#/entities/0/name"}, "an object"),
        (3, "an integer"),
    ],
)
def test_a_binding_whose_type_cannot_match_the_input_is_an_error(binding: Any, yields: str) -> None:
    [problem] = memory_problems(binding)
    assert problem.field == "compensatingOperation.parameters.entityNames" and problem.severity == "error"
    assert problem.message == f"binds {yields}, but 'delete_entities' takes 'entityNames' as an array"


def test_types_that_cannot_be_known_are_not_reported() -> None:
    unknown = {"create_entities": ToolSchemas({"type": "object"}, None), "delete_entities": ToolSchemas(DELETE_INPUT)}
    recovery = {
        "strategy": "compensation",
        "compensatingOperation": {"operationId": "delete_entities", "parameters": {"entityNames": "$response.body#/x"}},
    }
    assert [p.severity for p in check_declaration("create_entities", recovery, unknown)] == ["warning"]  # no schema
    open_input = {**MEMORY, "delete_entities": ToolSchemas({"type": "object", "properties": {"entityNames": {}}})}
    assert check_declaration("create_entities", memory_recovery("$response.body#/entities/0/name"), open_input) == []


def test_an_integer_binding_matches_a_number_input() -> None:
    tools = {
        "charge": ToolSchemas({"type": "object"}, {"type": "object", "properties": {"n": {"type": "integer"}}}),
        "undo": ToolSchemas({"type": "object", "properties": {"n": {"type": "number"}}}),
    }
    recovery = {
        "strategy": "compensation",
        "compensatingOperation": {"operationId": "undo", "parameters": {"n": "$response.body#/n"}},
    }
    assert check_declaration("charge", recovery, tools) == []
