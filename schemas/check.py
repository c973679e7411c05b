"""Static check of a recovery declaration against a server's live tool schemas (`saga check`).

A declaration is only exercised when a workflow fails, which is the worst moment to learn that it
names a tool the server does not have or a response field the tool never returns. Checking it
against `tools/list` finds those mistakes up front, without calling anything.

The schema walk is deliberately lenient: JSON Schema cannot be decided exactly here, and a false
alarm teaches operators to ignore the check. A pointer is an error only when the schema rules it
out (`additionalProperties: false`, a scalar type, `items: false`, `maxItems`); a property that
is merely not declared is a warning; `anyOf`/`oneOf`/`allOf` branches are alternatives (a pointer
passes when any branch can hold it); non-local `$ref`s and unconstrained schemas allow anything.
A missing response field only makes recovery unavailable at run time, but an argument the
compensating tool does not declare would be sent and most likely ignored, so a bound input that
is not among the tool's `properties` is an error even when `additionalProperties` would allow it.

Types are checked the same lenient way: a binding is an error only when what it yields (a
constant's type, a template's string, an array or object, or what the original tool's schema says
lies at its pointer; `*` yields an array) can never be of a type the compensating tool declares
for that input, e.g. one name bound where `delete_entities` takes `entityNames` as an array.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import msgspec
from mcp_saga.schemas.expressions import (
    Binding,
    Constant,
    Expression,
    ExpressionError,
    Structure,
    Template,
    parse_value,
    referenced_pointers,
)
from mcp_saga.schemas.pointer import ARRAY_INDEX, WILDCARD, PointerError, format_pointer, parse_pointer, resolve_pointer
from mcp_saga.schemas.recovery import Recovery, RecoveryError, parse_recovery

Severity = Literal["error", "warning"]

# Filled in by the worker from the compensation's stable key, never by the declaration.
WORKER_FILLED = frozenset({"idempotencyKey", "idempotency_key"})

_STRUCTURAL = ("type", "properties", "patternProperties", "additionalProperties", "items", "prefixItems")
_COMBINATORS = ("anyOf", "oneOf", "allOf")


class ToolSchemas(msgspec.Struct, frozen=True):
    input_schema: dict[str, Any] | None = None
    output_schema: dict[str, Any] | None = None

    @classmethod
    def from_wire(cls, tool: Mapping[str, Any]) -> ToolSchemas:
        """From one `tools/list` entry as on the wire (`inputSchema`, `outputSchema`)."""
        return cls(tool.get("inputSchema"), tool.get("outputSchema"))


class Problem(msgspec.Struct, frozen=True):
    tool: str
    field: str
    message: str
    severity: Severity = "error"


def check_declaration(
    tool: str,
    recovery: dict[str, Any] | Recovery,
    tools: Mapping[str, ToolSchemas],
    *,
    self_inverse: bool = False,
) -> list[Problem]:
    """`self_inverse`: whether this declaration may name `tool` itself (an operator overlay, or a
    server's declaration the policy consents to; see `Policy.self_inverse_refusal`)."""
    try:
        declared = parse_recovery(recovery)
    except RecoveryError as exc:
        return [Problem(tool, "recovery", str(exc))]
    if (reason := declared.unsupported_reason()) is not None:
        field = "strategy" if declared.compensating_operation is not None else "compensatingOperation"
        return [Problem(tool, field, reason)]
    op = declared.compensating_operation
    assert op is not None
    problems: list[Problem] = []

    def report(field: str, message: str, severity: Severity = "error") -> None:
        problems.append(Problem(tool, field, message, severity))

    if op.operation_id == tool and not self_inverse:
        report(
            "compensatingOperation.operationId",
            f"names {tool!r} itself: compensating would call it again (allowed in an overlay, or for a"
            " server's declaration with [policy] self_inverse)",
        )
    elif op.operation_id not in tools:
        report("compensatingOperation.operationId", f"the server does not list a tool {op.operation_id!r}")

    original = tools.get(tool)
    if original is None:
        report("recovery", f"{tool!r} is not listed by the server; its bindings were not checked", "warning")
    else:
        _check_bindings(tool, op.parameters, original, report)

    target = tools.get(op.operation_id)
    if target is not None and isinstance(target.input_schema, dict):
        _check_inputs(op.operation_id, op.parameters, target.input_schema, report)
        _check_types(op.operation_id, op.parameters, original, target.input_schema, report)
    return problems


def _check_types(
    operation: str,
    parameters: dict[str, Any],
    original: ToolSchemas | None,
    schema: dict[str, Any],
    report: Callable[..., None],
) -> None:
    for name, raw in parameters.items():
        try:
            bound = _yields(parse_value(raw), original)
        except ExpressionError:
            continue  # already reported by the declaration's own validation
        accepted = _input_types(schema, name)
        if bound is None or accepted is None or any(_compatible(kind, accepted) for kind in bound):
            continue
        report(
            f"compensatingOperation.parameters.{name}",
            f"binds {_describe(bound)}, but {operation!r} takes {name!r} as {_describe(accepted)}",
        )


def _input_types(schema: dict[str, Any], name: str) -> set[str] | None:
    """The types an input schema declares for one of its properties; None when open."""
    children = []
    for alt in _alternatives(schema, schema):
        if alt is True:
            return None
        status, child = _property(alt, name)
        if status == "ok":
            children.append(child)
    return _types_of(children, schema)


def _yields(binding: Binding, original: ToolSchemas | None) -> set[str] | None:
    """The JSON types a binding can resolve to; None when that cannot be known here."""
    if isinstance(binding, Constant):
        return {_schema_type(binding.value)}
    if isinstance(binding, Template):
        return {"string"}
    if isinstance(binding, Structure):
        return {"array" if binding.keys is None else "object"}
    assert isinstance(binding, Expression)
    if WILDCARD in binding.pointer:
        return {"array"}
    if original is None or binding.kind == "response.header":
        return None
    root = original.output_schema if binding.kind == "response.body" else original.input_schema
    if not isinstance(root, dict):
        return None
    current: list[Any] = [root]
    for token in binding.pointer:
        children = []
        for candidate in current:
            for alt in _alternatives(candidate, root):
                if alt is True:
                    return None
                status, child = _step(alt, token)
                if status == "ok":
                    children.append(child)
        current = children
    return _types_of(current, root)


def _types_of(schemas: list[Any], root: Any) -> set[str] | None:
    """The union of the declared types of some schemas; None if any of them allows any type."""
    found: set[str] = set()
    for schema in schemas:
        for alt in _alternatives(schema, root):
            types = None if alt is True else _types(alt)
            if types is None:
                return None
            found |= types
    return found or None


def _compatible(kind: str, accepted: set[str]) -> bool:
    numbers = {"integer", "number"}
    return kind in accepted or (kind in numbers and bool(numbers & accepted))


def _schema_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _describe(types: set[str]) -> str:
    return " or ".join(("an " if t[0] in "aeiou" else "a ") + t for t in sorted(types))


def _check_bindings(tool: str, parameters: dict[str, Any], schemas: ToolSchemas, report: Callable[..., None]) -> None:
    reads_text: list[str] = []
    for name, kind, tokens in referenced_pointers(parameters):
        field = f"compensatingOperation.parameters.{name}"
        if kind == "response.body":
            schema, which, prefix = schemas.output_schema, "outputSchema", "$response.body"
            if schema is None:
                reads_text.append(name)
                continue
        elif kind == "request.body":
            schema, which, prefix = schemas.input_schema, "inputSchema", "$request.body"
        else:
            continue
        if schema is not None and (found := _pointer_problem(schema, tokens)) is not None:
            severity, reason = found
            report(field, f"`{prefix}#{format_pointer(tokens)}`: {which} of {tool!r} {reason}", severity)
    if reads_text:
        names = ", ".join(dict.fromkeys(reads_text))
        report(
            "compensatingOperation.parameters",
            f"{tool!r} has no outputSchema: $response.body in {names} relies on its result being a single"
            " JSON text block",
            "warning",
        )


def _check_inputs(
    operation: str, parameters: dict[str, Any], schema: dict[str, Any], report: Callable[..., None]
) -> None:
    alternatives = _alternatives(schema, schema)
    required = {name for name in _list(schema, "required") if isinstance(name, str)}
    for name in sorted(required - parameters.keys() - WORKER_FILLED):
        report(f"compensatingOperation.parameters.{name}", f"required input of {operation!r} is not bound")
    if not alternatives or any(alt is True for alt in alternatives):
        return
    for name in parameters:
        outcomes = [_property(alt, name) for alt in alternatives]
        if any(outcome[0] == "ok" for outcome in outcomes):
            continue
        field = f"compensatingOperation.parameters.{name}"
        if any(outcome[0] == "undeclared" for outcome in outcomes):
            report(field, f"{operation!r} has no input {name!r} in its inputSchema properties")
        else:
            report(field, f"{operation!r} does not accept an input {name!r} (additionalProperties is false)")


def _pointer_problem(schema: dict[str, Any], tokens: tuple[str, ...]) -> tuple[Severity, str] | None:
    """Whether some instance of `schema` can have a value at `tokens`, and if not, why."""
    current: list[Any] = [schema]
    for depth, token in enumerate(tokens):
        at = format_pointer(tokens[: depth + 1])
        children, warning, error = [], None, None
        for candidate in current:
            for alt in _alternatives(candidate, schema):
                if alt is True:
                    return None
                status, detail = _step(alt, token)
                if status == "ok":
                    children.append(detail)
                elif status == "undeclared":
                    warning = warning or detail
                else:
                    error = error or detail
        if not children:
            if warning is not None:
                return "warning", f"{warning} at {at}"
            return "error", f"{error or 'allows nothing'} at {at}"
        current = children
    if not any(_alternatives(candidate, schema) for candidate in current):
        return "error", f"allows nothing at {format_pointer(tokens)}"
    return None


def _alternatives(schema: Any, root: Any, seen: frozenset[str] = frozenset()) -> list[Any]:
    """The shapes a value may take: True for "anything", else dicts whose structural keywords
    apply directly. A schema (or anyOf/oneOf branch) with no structural keyword allows anything;
    an allOf branch without one adds nothing to its siblings."""
    if not isinstance(schema, dict):
        return [] if schema is False else [True]
    own: list[Any] = [schema] if any(key in schema for key in _STRUCTURAL) else []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target: Any = True
        if ref.startswith("#") and ref not in seen:
            try:
                target = resolve_pointer(root, parse_pointer(ref[1:]))
            except PointerError:
                target = True
        own += _alternatives(target, root, seen | {ref})
    branches: list[Any] = []
    open_branch = False
    for key in _COMBINATORS:
        for branch in _list(schema, key):
            alts = _alternatives(branch, root, seen)
            if True in alts:
                open_branch = open_branch or key != "allOf"
                alts = [alt for alt in alts if alt is not True]
            branches += alts
    if open_branch and not own:
        return [True]
    return own + branches or [True]


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else None


def _step(schema: dict[str, Any], token: str) -> tuple[str, Any]:
    """One token down one alternative: ("ok", child schema), ("undeclared", why) or ("no", why)."""
    types = _types(schema)
    as_object = (
        "object" in types
        if types is not None
        else _has(schema, "properties", "patternProperties", "additionalProperties")
    )
    as_array = "array" in types if types is not None else _has(schema, "items", "prefixItems")
    outcomes = []
    if as_object:
        outcomes.append(_property(schema, token))
    if as_array:
        outcomes.append(_item(schema, token))
    if not outcomes:
        shown = "/".join(sorted(types)) if types else "a value"
        return "no", f"allows only {shown}, which cannot hold {token!r},"
    return min(outcomes, key=lambda outcome: ("ok", "undeclared", "no").index(outcome[0]))


def _has(schema: dict[str, Any], *keys: str) -> bool:
    return any(key in schema for key in keys)


def _dict(schema: dict[str, Any], key: str) -> dict[str, Any]:
    value = schema.get(key)
    return value if isinstance(value, dict) else {}


def _list(schema: dict[str, Any], key: str) -> list[Any]:
    value = schema.get(key)
    return value if isinstance(value, list) else []


def _property(schema: dict[str, Any], name: str) -> tuple[str, Any]:
    properties, patterns = _dict(schema, "properties"), _dict(schema, "patternProperties")
    if name in properties:
        return "ok", properties[name]
    for pattern, child in patterns.items():
        try:
            if re.search(pattern, name):
                return "ok", child
        except re.error:
            return "ok", True
    extra = schema.get("additionalProperties")
    if extra is False:
        return "no", f"has no property {name!r} (additionalProperties is false)"
    if extra is None and (properties or patterns):
        return "undeclared", f"does not declare a property {name!r}"
    return "ok", True if extra is None else extra


def _item(schema: dict[str, Any], token: str) -> tuple[str, Any]:
    if token == WILDCARD:  # the projection reads every item: those after any tuple prefix
        rest = schema.get("items")
        return "ok", True if rest is None or isinstance(rest, list) else rest
    if not ARRAY_INDEX.fullmatch(token):
        return "no", f"expects an array index, not {token!r},"
    index = int(token)
    prefix, rest = _list(schema, "prefixItems"), schema.get("items")
    if isinstance(rest, list):  # draft 2019-09 and earlier: items as a tuple
        prefix, rest = rest, schema.get("additionalItems")
    max_items = schema.get("maxItems")
    if isinstance(max_items, int) and index >= max_items:
        return "no", f"has at most {max_items} items, no index {index}"
    if index < len(prefix):
        return "ok", prefix[index]
    if rest is False:
        return "no", f"has no index {index} (only {len(prefix)} items)"
    return "ok", True if rest is None else rest
