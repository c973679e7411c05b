from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp_saga.schemas.expressions import (
    CUT_META_KEY,
    Constant,
    Expression,
    ExpressionError,
    Structure,
    Template,
    UnresolvableError,
    compile_parameters,
    keep_only,
    parse_value,
    referenced_pointers,
    resolve_parameters,
    resolve_value,
    response_body,
    select,
)
from mcp_saga.schemas.pointer import PointerError, format_pointer

# The SEP's reference call: charge_payment returned this and is compensated by refund_payment.
CHARGE_ARGUMENTS = {"orderId": "order-42", "amount": 59.97, "card": {"last4": "4242"}}
CHARGE_BODY = {"transactionId": "TXN-123", "amount": 59.97, "items": [{"sku": "A", "qty": 2}], "ok": True}
CHARGE_RESULT = {
    "content": [{"type": "text", "text": json.dumps(CHARGE_BODY)}],
    "structuredContent": CHARGE_BODY,
    "isError": False,
    "_meta": {"com.example/receipt": "R-9", "traceId": 7},
}


def text_result(text: str, **extra: Any) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], **extra}


def resolve(binding: Any, result: dict[str, Any] = CHARGE_RESULT) -> Any:
    return resolve_value(binding, arguments=CHARGE_ARGUMENTS, result=result)


# parse_value: the three shapes


@pytest.mark.parametrize(
    "value",
    [59.97, 3, 0, None, True, False, {"a": "b"}, ["x", {"y": [1]}], "refund", "", "costs 5$", "a {b} c"],
)
def test_non_expressions_are_constants(value: Any) -> None:
    assert parse_value(value) == Constant(value)


def test_json_text_with_braces_stays_a_constant() -> None:
    assert parse_value('{"id": 1}') == Constant('{"id": 1}')
    assert parse_value("{ $response.body#/id }") == Constant("{ $response.body#/id }")


@pytest.mark.parametrize(
    ("source", "kind", "pointer"),
    [
        ("$response.body", "response.body", ()),
        ("$response.body#", "response.body", ()),
        ("$response.body#/transactionId", "response.body", ("transactionId",)),
        ("$response.body#/items/0/sku", "response.body", ("items", "0", "sku")),
        ("$response.body#/a~1b/m~0n", "response.body", ("a/b", "m~n")),
        ("$response.body#/", "response.body", ("",)),
        ("$request.body", "request.body", ()),
        ("$request.body#/card/last4", "request.body", ("card", "last4")),
    ],
)
def test_body_expressions_parse_to_a_kind_and_pointer(source: str, kind: str, pointer: tuple[str, ...]) -> None:
    assert parse_value(source) == Expression(source, kind, pointer)


@pytest.mark.parametrize("name", ["traceId", "X-Request-Id", "com.example/receipt", "a!#$%&'*+-.^_`|~9"])
def test_header_expressions_name_a_meta_key(name: str) -> None:
    source = f"$response.header.{name}"
    assert parse_value(source) == Expression(source, "response.header", name=name)


def test_template_splits_literals_and_expressions() -> None:
    binding = parse_value(
        "order {$request.body#/orderId}: refund {$response.body#/amount} ({$response.header.traceId})"
    )
    assert binding == Template(
        (
            "order ",
            Expression("$request.body#/orderId", "request.body", ("orderId",)),
            ": refund ",
            Expression("$response.body#/amount", "response.body", ("amount",)),
            " (",
            Expression("$response.header.traceId", "response.header", name="traceId"),
            ")",
        )
    )


def test_template_keeps_braces_that_do_not_open_an_expression() -> None:
    binding = parse_value("{{$response.body#/ok}} {x}")
    assert binding == Template(("{", Expression("$response.body#/ok", "response.body", ("ok",)), "} {x}"))


def test_template_of_only_expressions_has_no_empty_literals() -> None:
    binding = parse_value("{$response.body#/a}{$response.body#/b}")
    assert isinstance(binding, Template)
    assert [part.source for part in binding.parts] == ["$response.body#/a", "$response.body#/b"]


def test_parse_value_passes_parsed_bindings_through() -> None:
    for binding in (Constant(1), Expression("$request.body", "request.body"), Template(("x",))):
        assert parse_value(binding) is binding


# parse_value: forms MCP has no counterpart for, and malformed expressions


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("$url", "no URL"),
        ("$method", "no HTTP method"),
        ("$statusCode", "no status code"),
        ("$request.query.page", "no query parameters"),
        ("$request.path.id", "no path parameters"),
        ("$request.header.Authorization", "MCP requests have no headers"),
        ("$response.query.page", "no query parameters"),
        ("$response.path.id", "no path parameters"),
    ],
)
def test_forms_without_an_mcp_counterpart_are_rejected(source: str, why: str) -> None:
    with pytest.raises(ExpressionError) as caught:
        parse_value(source)
    assert str(caught.value).startswith(f"`{source}`: ")
    assert why in str(caught.value)
    assert caught.value.expression == source


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("$", "not a runtime expression"),
        ("$5.00", "not a runtime expression"),
        ("$foo.body", "not a runtime expression"),
        ("$response", "not a runtime expression"),
        ("$Response.body", "not a runtime expression"),
        ("$response.body.transactionId", "a body pointer follows '#'"),
        ("$response.bodyx", "a body pointer follows '#'"),
        ("$response.body#transactionId", "must be empty or start with '/'"),
        ("$response.body#/a~2", "'~' must be followed by '0' or '1'"),
        ("$request.body#/a~", "'~' must be followed by '0' or '1'"),
        ("$response.header.", "is not a header name"),
        ("$response.header.a b", "is not a header name"),
        ("$response.header.a:b", "is not a header name"),
        ("$response.cookie.sid", "unknown source 'cookie.sid'"),
        ("$response.", "unknown source ''"),
    ],
)
def test_strings_starting_with_dollar_must_be_valid_expressions(source: str, why: str) -> None:
    with pytest.raises(ExpressionError) as caught:
        parse_value(source)
    assert str(caught.value).startswith(f"`{source}`: ")
    assert why in str(caught.value)


def test_a_string_starting_with_dollar_is_never_a_template() -> None:
    source = "$response.body#/id ignored {$response.body#/x}"
    # The grammar lets pointer tokens hold spaces and braces, so this is one whole expression.
    assert parse_value(source) == Expression(source, "response.body", ("id ignored {$response.body#", "x}"))


@pytest.mark.parametrize(
    ("template", "expression", "why"),
    [
        ("order {$response.body#/id", "{$response.body#/id", "no closing '}'"),
        ("order {$url}", "$url", "no URL"),
        ("x {$response.boddy#/id} y", "$response.boddy#/id", "unknown source"),
        ("{$}", "$", "not a runtime expression"),
        ("{$request.query.q}", "$request.query.q", "no query parameters"),
    ],
)
def test_template_errors_name_the_expression_and_the_template(template: str, expression: str, why: str) -> None:
    with pytest.raises(ExpressionError) as caught:
        parse_value(template)
    assert caught.value.expression == expression
    assert caught.value.template == template
    assert why in str(caught.value)
    assert str(caught.value).endswith(f"(in template {template!r})")


def test_errors_survive_pickling_for_job_queues() -> None:
    parse_error = ExpressionError("$url", "MCP tool calls have no URL", "x {$url}")
    resolve_error = UnresolvableError("$response.body#/id", "key 'id' missing at /id", "transactionId")
    for error in (parse_error, resolve_error):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)


prefixes = st.sampled_from(
    [
        "",
        "$",
        "{$",
        "x {$",
        "$response.",
        "$request.",
        "$response.body",
        "$response.body#",
        "$request.body#/",
        "$response.header.",
        "$request.header.",
        "{$response.body#/a}",
    ]
)


@given(st.text())
def test_parse_value_raises_only_expression_errors_on_any_text(text: str) -> None:
    try:
        binding = parse_value(text)
    except ExpressionError as exc:
        assert str(exc)
    else:
        assert isinstance(binding, Constant | Expression | Template)


@given(prefixes, st.text())
def test_parse_value_raises_only_expression_errors_near_valid_forms(prefix: str, rest: str) -> None:
    text = prefix + rest
    try:
        binding = parse_value(text)
    except ExpressionError as exc:
        assert exc.expression
    else:
        assert text.startswith("$") == isinstance(binding, Expression)


# response_body


def test_body_is_structured_content_when_present() -> None:
    result = {"structuredContent": {"id": 1}, "content": [{"type": "text", "text": '{"id": 2}'}]}
    assert response_body(result) == {"id": 1}


@pytest.mark.parametrize(
    ("text", "body"),
    [('{"id": "T-1"}', {"id": "T-1"}), ("[1, 2]", [1, 2]), ("42", 42), ('"plain"', "plain"), ("null", None)],
)
def test_body_falls_back_to_the_json_of_the_single_text_block(text: str, body: Any) -> None:
    assert response_body(text_result(text)) == body


def test_null_structured_content_falls_back_to_text() -> None:
    assert response_body(text_result('{"id": 3}', structuredContent=None)) == {"id": 3}


def test_non_text_blocks_do_not_count() -> None:
    result = {"content": [{"type": "image", "data": "AA==", "mimeType": "image/png"}, {"type": "text", "text": "{}"}]}
    assert response_body(result) == {}


def unresolvable_body(result: Any) -> UnresolvableError:
    with pytest.raises(UnresolvableError) as caught:
        response_body(result)
    assert caught.value.expression == "$response.body"
    return caught.value


def test_body_of_a_failed_call_is_unresolvable_even_with_structured_content() -> None:
    error = unresolvable_body({"structuredContent": {"id": 1}, "isError": True})
    assert error.reason == "the call failed (isError is true)"


@pytest.mark.parametrize(
    ("result", "found"),
    [
        ({}, "no text content block"),
        ({"content": []}, "no text content block"),
        ({"content": [{"type": "image", "data": "", "mimeType": "image/png"}]}, "no text content block"),
        ({"content": [{"type": "text", "text": "{}"}, {"type": "text", "text": "{}"}]}, "2 text content blocks"),
    ],
)
def test_body_needs_structured_content_or_exactly_one_text_block(result: dict[str, Any], found: str) -> None:
    error = unresolvable_body(result)
    assert error.reason == f"no structuredContent and {found} (need exactly one)"


@pytest.mark.parametrize("text", ["Charged TXN-123", "", "{'id': 1}", '{"id": 1'])
def test_body_text_that_is_not_json_is_unresolvable(text: str) -> None:
    error = unresolvable_body(text_result(text))
    assert error.reason.startswith("no structuredContent and the text is not JSON")


def test_body_of_something_that_is_not_a_result_is_unresolvable() -> None:
    assert "is an array, not an object" in unresolvable_body([]).reason


# resolve_value


def test_the_sep_example_binds_the_transaction_id() -> None:
    assert resolve("$response.body#/transactionId") == "TXN-123"


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("$response.body#/amount", 59.97),
        ("$response.body#/ok", True),
        ("$response.body#/items", [{"sku": "A", "qty": 2}]),
        ("$response.body#/items/0", {"sku": "A", "qty": 2}),
        ("$response.body#/items/0/qty", 2),
        ("$response.body", CHARGE_BODY),
        ("$request.body", CHARGE_ARGUMENTS),
        ("$request.body#/card", {"last4": "4242"}),
        ("$request.body#/amount", 59.97),
        ("$response.header.traceId", 7),
        ("$response.header.com.example/receipt", "R-9"),
    ],
)
def test_whole_value_expressions_keep_the_json_type(source: str, value: Any) -> None:
    resolved = resolve(source)
    assert resolved == value
    assert type(resolved) is type(value)


def test_body_from_text_block_resolves_like_structured_content() -> None:
    result = text_result(json.dumps(CHARGE_BODY))
    assert resolve("$response.body#/items/0/sku", result) == "A"


def test_templates_render_strings_raw_and_other_values_as_compact_json() -> None:
    template = "order {$request.body#/orderId} {$response.body#/amount} {$response.body#/items/0} {$response.body#/ok}"
    assert resolve(template) == 'order order-42 59.97 {"sku":"A","qty":2} true'


def test_templates_render_null_and_unicode_as_json() -> None:
    result = {"structuredContent": {"none": None, "name": ["café"]}}
    assert resolve("{$response.body#/none}/{$response.body#/name}", result) == 'null/["café"]'


def test_a_template_of_one_expression_still_yields_a_string() -> None:
    assert resolve("{$response.body#/amount}") == "59.97"


def test_constants_resolve_to_themselves() -> None:
    assert resolve(Constant({"a": [1]})) == {"a": [1]}
    assert resolve("full refund") == "full refund"
    assert resolve(None) is None


def test_parsed_bindings_resolve_like_raw_ones() -> None:
    assert resolve(parse_value("$response.body#/transactionId")) == "TXN-123"


def test_resolving_an_unparsable_raw_value_raises_expression_error() -> None:
    with pytest.raises(ExpressionError):
        resolve("$method")


def unresolvable(binding: Any, result: dict[str, Any] = CHARGE_RESULT, **arguments: Any) -> UnresolvableError:
    with pytest.raises(UnresolvableError) as caught:
        resolve_value(binding, arguments=arguments or CHARGE_ARGUMENTS, result=result)
    return caught.value


def test_missing_field_reads_like_the_expression_and_where() -> None:
    error = unresolvable("$response.body#/id", {"structuredContent": {"transactionId": "T"}})
    assert str(error) == "`$response.body#/id`: key 'id' missing at /id"
    assert error.expression == "$response.body#/id"
    assert error.reason == "key 'id' missing at /id"


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("$response.body#/items/1", "index 1 out of range (length 1) at /items/1"),
        ("$response.body#/items/00", "'00' is not an array index (leading zero) at /items/00"),
        ("$response.body#/items/-", "'-' (past the last element) never resolves at /items/-"),
        ("$response.body#/items/first", "'first' is not an array index at /items/first"),
        ("$response.body#/amount/cents", "cannot look up 'cents' in a number at /amount/cents"),
        ("$response.body#/transactionId/0", "cannot look up '0' in a string at /transactionId/0"),
        ("$request.body#/card/cvc", "key 'cvc' missing at /card/cvc"),
        ("$response.header.missing", "_meta has no key 'missing'"),
    ],
)
def test_every_kind_of_pointer_failure_is_unresolvable(source: str, reason: str) -> None:
    error = unresolvable(source)
    assert (error.expression, error.reason) == (source, reason)


def test_header_without_meta_is_unresolvable() -> None:
    assert unresolvable("$response.header.traceId", {"structuredContent": {}}).reason == "the result has no _meta"


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ({**CHARGE_RESULT, "isError": True}, "the call failed (isError is true)"),
        ({"content": []}, "no structuredContent and no text content block (need exactly one)"),
    ],
)
def test_body_failures_are_reported_against_the_expression(result: dict[str, Any], reason: str) -> None:
    error = unresolvable("$response.body#/transactionId", result)
    assert (error.expression, error.reason) == ("$response.body#/transactionId", reason)


def test_text_that_is_not_json_makes_a_body_expression_unresolvable() -> None:
    error = unresolvable("$response.body#/transactionId", text_result("Charged TXN-123"))
    assert error.reason.startswith("no structuredContent and the text is not JSON")


def test_a_failing_template_part_names_that_part() -> None:
    error = unresolvable("order {$request.body#/orderId} txn {$response.body#/nope}")
    assert error.expression == "$response.body#/nope"


def test_request_body_does_not_need_a_usable_response() -> None:
    assert resolve("$request.body#/orderId", {"isError": True}) == "order-42"


@given(
    st.lists(st.one_of(st.text().map(lambda k: ("key", k)), st.integers(0, 3).map(lambda i: ("index", i))), max_size=5),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(), inner, max_size=2),
        max_leaves=6,
    ),
)
def test_whole_value_expressions_return_what_was_placed_at_a_random_path(
    path: list[tuple[str, Any]], leaf: Any
) -> None:
    node = leaf
    for kind, step in reversed(path):
        node = {step: node, "~other/": 0} if kind == "key" else [0] * step + [node]
    pointer = format_pointer(["root", *(str(step) for _, step in path)])
    body = {"root": node}
    assert resolve_value(f"$response.body#{pointer}", arguments={}, result={"structuredContent": body}) == leaf
    assert resolve_value(f"$response.body#{pointer}", arguments={}, result=text_result(json.dumps(body))) == leaf
    assert resolve_value(f"$request.body#{pointer}", arguments=body, result={}) == leaf


# resolve_parameters


def test_resolve_parameters_binds_every_parameter() -> None:
    parameters = {
        "transactionId": "$response.body#/transactionId",
        "amount": "$request.body#/amount",
        "reason": "saga compensation for {$request.body#/orderId}",
        "notify": False,
    }
    assert resolve_parameters(parameters, arguments=CHARGE_ARGUMENTS, result=CHARGE_RESULT) == {
        "transactionId": "TXN-123",
        "amount": 59.97,
        "reason": "saga compensation for order-42",
        "notify": False,
    }


def test_resolve_parameters_of_nothing_is_nothing() -> None:
    assert resolve_parameters({}, arguments={}, result={}) == {}


@pytest.mark.parametrize("position", [0, 1, 2])
def test_an_unresolvable_parameter_never_yields_arguments(position: int) -> None:
    names = ["transactionId", "amount", "reason"]
    parameters: dict[str, Any] = {
        "transactionId": "$response.body#/transactionId",
        "amount": "$request.body#/amount",
        "reason": "fixed",
    }
    parameters[names[position]] = "$response.body#/absent"
    outcome: dict[str, Any] | None = None
    with pytest.raises(UnresolvableError) as caught:
        outcome = resolve_parameters(parameters, arguments=CHARGE_ARGUMENTS, result=CHARGE_RESULT)
    assert outcome is None
    assert caught.value.parameter == names[position]
    assert (
        str(caught.value) == f"parameter {names[position]!r}: `$response.body#/absent`: key 'absent' missing at /absent"
    )


def test_resolve_parameters_reports_the_first_failing_parameter() -> None:
    parameters = {"a": "$response.body#/transactionId", "b": "$response.body#/x", "c": "$response.body#/y"}
    with pytest.raises(UnresolvableError) as caught:
        resolve_parameters(parameters, arguments={}, result=CHARGE_RESULT)
    assert caught.value.parameter == "b"


def test_resolve_parameters_of_a_failed_call_yields_nothing() -> None:
    with pytest.raises(UnresolvableError, match=r"parameter 'transactionId': .*isError is true"):
        resolve_parameters(
            {"transactionId": "$response.body#/transactionId"},
            arguments=CHARGE_ARGUMENTS,
            result={**CHARGE_RESULT, "isError": True},
        )


def test_an_unparsable_binding_makes_the_parameter_set_unresolvable() -> None:
    with pytest.raises(UnresolvableError) as caught:
        resolve_parameters({"ok": "fixed", "when": "$statusCode"}, arguments={}, result=CHARGE_RESULT)
    assert (caught.value.parameter, caught.value.expression) == ("when", "$statusCode")
    assert "no status code" in caught.value.reason


# compile_parameters: resolve_parameters prepared once per declaration (the coordinator's fast path)

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["", "a", "~/", "*", "0"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "0", "*", "~"]), inner, max_size=3)
    ),
    max_leaves=8,
)
_POINTERS = st.lists(st.sampled_from(["a", "b", "0", "1", "01", "-", "*", "~0", "~1"]), max_size=3).map(
    lambda tokens: "".join("/" + token for token in tokens)
)
_EXPRESSIONS = st.one_of(
    _POINTERS.map(lambda p: f"$response.body#{p}"),
    _POINTERS.map(lambda p: f"$request.body#{p}"),
    st.just("$response.body"),
    st.sampled_from(["$response.header.a", "$response.header.traceId", "$statusCode", "$response.body#a"]),
)
_BINDINGS = st.recursive(
    _EXPRESSIONS | _EXPRESSIONS.map(lambda e: f"id {{{e}}}-{{{e}}}") | _JSON,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(["x", "y"]), inner, max_size=2),
    max_leaves=4,
)
_RESULTS = st.fixed_dictionaries(
    {},
    optional={
        "structuredContent": _JSON,
        "content": st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": _JSON.map(json.dumps)}),
            max_size=2,
        ),
        "isError": st.booleans(),
        "_meta": st.dictionaries(st.sampled_from(["a", "traceId", CUT_META_KEY]), _JSON, max_size=2),
    },
)


def _outcome(resolve: Any) -> Any:
    try:
        return "ok", resolve()
    except UnresolvableError as exc:
        return "unresolvable", str(exc), exc.parameter


@given(st.dictionaries(st.sampled_from(["p", "q", "r"]), _BINDINGS, max_size=3), _JSON, _RESULTS)
def test_a_compiled_declaration_resolves_exactly_as_resolve_parameters(
    parameters: dict[str, Any], arguments: Any, result: dict[str, Any]
) -> None:
    compiled = compile_parameters(parameters)
    expected = _outcome(lambda: resolve_parameters(parameters, arguments=arguments, result=result))
    assert _outcome(lambda: compiled(arguments, result)) == expected


def test_a_compiled_declaration_binds_the_reference_call() -> None:
    parameters = {
        "transactionId": "$response.body#/transactionId",
        "sku": "$response.body#/items/0/sku",
        "reason": "refund {$request.body#/orderId} ({$response.body#/amount})",
        "receipt": "$response.header.com.example/receipt",
        "all": ["$response.body#/items/*/qty", {"card": "$request.body#/card/last4"}],
        "notify": False,
    }
    assert compile_parameters(parameters)(CHARGE_ARGUMENTS, CHARGE_RESULT) == {
        "transactionId": "TXN-123",
        "sku": "A",
        "reason": "refund order-42 (59.97)",
        "receipt": "R-9",
        "all": [[2], {"card": "4242"}],
        "notify": False,
    }


def test_a_compiled_declaration_reports_what_resolve_parameters_reports() -> None:
    compiled = compile_parameters({"a": "$response.body#/transactionId", "b": "$response.body#/x"})
    with pytest.raises(UnresolvableError) as caught:
        compiled({}, CHARGE_RESULT)
    assert str(caught.value) == "parameter 'b': `$response.body#/x`: key 'x' missing at /x"
    with pytest.raises(UnresolvableError, match="no status code"):
        compile_parameters({"when": "$statusCode"})({}, CHARGE_RESULT)


# referenced_pointers


def test_referenced_pointers_lists_every_expression_with_its_parameter() -> None:
    parameters = {
        "transactionId": "$response.body#/transactionId",
        "note": "{$request.body#/orderId}-{$response.body#/items/0/sku}",
        "trace": "$response.header.traceId",
        "whole": "$response.body",
        "constant": 5,
        "text": "no expressions {here}",
    }
    assert referenced_pointers(parameters) == [
        ("transactionId", "response.body", ("transactionId",)),
        ("note", "request.body", ("orderId",)),
        ("note", "response.body", ("items", "0", "sku")),
        ("trace", "response.header", ("traceId",)),
        ("whole", "response.body", ()),
    ]


def test_referenced_pointers_rejects_unparsable_bindings() -> None:
    with pytest.raises(ExpressionError, match="no HTTP method"):
        referenced_pointers({"m": "$method"})


# Bindings inside arrays and objects, and the `*` projection (our extension)

MEMORY_BODY = {"entities": [{"name": "Ada", "entityType": "person"}, {"name": "Bob", "entityType": "person"}]}
MEMORY_RESULT = {"content": [{"type": "text", "text": json.dumps(MEMORY_BODY)}]}


def test_an_expression_inside_an_array_is_resolved() -> None:
    assert resolve(["$response.body#/entities/0/name"], MEMORY_RESULT) == ["Ada"]


def test_expressions_anywhere_inside_arrays_and_objects_are_resolved_keeping_the_shape() -> None:
    declared = {"who": ["$response.body#/entities/1/name", {"type": "$response.body#/entities/0/entityType"}]}
    declared["note"] = {"order": "{$request.body#/orderId} undone", "fixed": [1, None]}
    assert resolve(declared, MEMORY_RESULT) == {
        "who": ["Bob", {"type": "person"}],
        "note": {"order": "order-42 undone", "fixed": [1, None]},
    }
    binding = parse_value(declared)
    assert isinstance(binding, Structure) and binding.keys == ("who", "note")


def test_an_unparsable_expression_inside_an_array_is_an_error_not_a_constant() -> None:
    with pytest.raises(ExpressionError, match="no URL"):
        parse_value(["$url"])


def test_an_unresolvable_expression_inside_an_object_makes_the_whole_set_unresolvable() -> None:
    with pytest.raises(UnresolvableError, match=r"parameter 'names'.*entities/5"):
        resolve_parameters({"names": ["$response.body#/entities/5/name"]}, arguments={}, result=MEMORY_RESULT)


def test_star_projects_every_item_of_an_array() -> None:
    assert resolve("$response.body#/entities/*/name", MEMORY_RESULT) == ["Ada", "Bob"]
    assert resolve("$response.body#/entities/*", MEMORY_RESULT) == MEMORY_BODY["entities"]
    assert resolve("$response.body#/entities/*/name", text_result('{"entities": []}')) == []
    assert resolve("$request.body#/card/last4") == "4242"


def test_nested_stars_give_nested_lists() -> None:
    body = {"orders": [{"items": [{"sku": "A"}, {"sku": "B"}]}, {"items": []}]}
    assert resolve("$response.body#/orders/*/items/*/sku", text_result(json.dumps(body))) == [["A", "B"], []]


def test_star_on_an_object_is_the_plain_key_as_in_rfc_6901() -> None:
    assert resolve("$response.body#/*", text_result('{"*": 5}')) == 5


def test_a_projection_fails_naming_the_item_that_lacks_the_field() -> None:
    body = {"entities": [{"name": "Ada"}, {"entityType": "person"}]}
    with pytest.raises(UnresolvableError, match="key 'name' missing at /entities/1/name"):
        resolve("$response.body#/entities/*/name", text_result(json.dumps(body)))
    with pytest.raises(UnresolvableError, match="'\\*' projects an array, not a string at /entities/0/name/\\*"):
        resolve("$response.body#/entities/*/name/*", MEMORY_RESULT)


def test_referenced_pointers_finds_expressions_inside_structures() -> None:
    found = referenced_pointers({"names": ["$response.body#/entities/*/name", {"k": "$request.body#/id"}]})
    assert found == [("names", "response.body", ("entities", "*", "name")), ("names", "request.body", ("id",))]


# keep_only: a document cut to what some pointers read


def test_keep_only_keeps_exactly_what_the_pointers_read() -> None:
    doc = {"id": 1, "blob": "x" * 100, "rows": [{"k": 1, "pad": 0}, {"k": 2, "pad": 0}], "list": [5, 6, 7, 8]}
    kept = keep_only(doc, [("id",), ("rows", "*", "k"), ("list", "2"), ("missing", "x")])
    assert kept == {"id": 1, "rows": [{"k": 1}, {"k": 2}], "list": [None, None, 7]}
    assert keep_only(doc, []) is None
    assert keep_only(doc, [("rows",), ("rows", "0", "k")]) == {"rows": doc["rows"]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab*"), inner, max_size=3),
    max_leaves=12,
)
tokens = st.lists(st.sampled_from(["a", "b", "*", "0", "1"]), max_size=3).map(tuple)


@given(json_values, st.lists(tokens, min_size=1, max_size=4))
def test_every_pointer_reads_the_same_from_the_kept_document(doc: Any, pointers: list[tuple[str, ...]]) -> None:
    kept = keep_only(doc, pointers)
    for pointer in pointers:
        try:
            expected = select(doc, pointer)
        except PointerError:
            continue
        assert select(kept, pointer) == expected
