"""OpenAPI 3.0 `Link` runtime expressions, applied to a stored MCP tool call (SEP-3172 section 4.2).

What each expression reads, given the original call's `arguments` and its CallToolResult `result`
(wire form: `structuredContent`, `content`, `isError`, `_meta`):

- `$response.body` / `$response.body#/json/pointer`: the result's body, i.e. `structuredContent`,
  else the JSON parsed from its single text content block (`response_body`).
- `$request.body` / `$request.body#/json/pointer`: the original call's `arguments`. OpenAPI gives
  this a meaning for HTTP; for MCP it is our extension, and the only way to bind an input the
  response does not echo.
- `$response.header.<name>`: `result["_meta"][<name>]`. MCP results have no headers; `_meta` is the
  closest per-result metadata. The name is matched exactly (`_meta` keys are case-sensitive) and,
  beyond the HTTP token characters, may contain `/` because prefixed `_meta` keys do.

`$url`, `$method`, `$statusCode`, `$request.query.*`, `$request.path.*`, `$request.header.*` (and
the `$response` query/path forms) have no MCP counterpart and are rejected when parsed rather than
resolved to something made up: a compensation must never run with invented arguments.

Extension (ours, beside `$request.body`): a `*` token in a body pointer projects an array,
`$response.body#/entities/*/name` is the list of every entity's name (`[]` for no entities), so a
tool that creates many things can be undone by one call that takes their names. `*` is never a
valid array index in RFC 6901, so no standard pointer changes meaning; on an object it stays the
plain key `"*"`.

A binding is one of four shapes. A string that starts with `$` must be one whole expression and
keeps the JSON type of what it points to. A string containing `{$...}` is a template and always
yields a string; each `{$` opens an expression that ends at the next `}` (so a pointer inside a
template cannot address a key containing `}`), while any other `{` or `}` is literal. An array or
object holding a binding anywhere inside (`["$response.body#/entities/0/name"]`,
`{"id": "$request.body#/id"}`) is resolved member by member, at any depth, keeping its shape: a
list sent verbatim with the expression text in it would make the tool undo nothing and answer
success. Everything else is a constant. There is no escape for a literal string starting with
`$`: such a constant is far more likely to be a mistyped expression than a value, and silently
sending the text would call the compensating tool with a wrong argument.

Resolving a parameter set is all or nothing: the SEP requires that an unresolvable binding makes
recovery unavailable, never a call with partial or default arguments.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from mcp_saga.schemas.pointer import (
    ARRAY_INDEX,
    WILDCARD,
    PointerError,
    format_pointer,
    json_type,
    parse_pointer,
    resolve_pointer,
)
from mcp_saga.schemas.results import text_blocks

Kind = Literal["response.body", "request.body", "response.header"]

_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z/]+")
_NO_COUNTERPART = {
    "$url": "MCP tool calls have no URL",
    "$method": "MCP tool calls have no HTTP method (the operation is always tools/call)",
    "$statusCode": "MCP results have no status code (a result with isError true is never resolved)",
}
# Where a publisher that had to cut a step's result down to the event cap says so, in the stored
# result's `_meta` (reverse-DNS, like our other keys): `bytes` (the original size), `cap`, `tool`,
# `kept` (the pointers kept for the recovery's bindings), `complete` (whether they all fit) and
# `argumentsCut` (whether the arguments had to be cut too).
CUT_META_KEY = "io.github.mcp-saga/cut"
_EXPECTED = "expected $response.body#/pointer, $request.body#/pointer or $response.header.<name>"


class ExpressionError(ValueError):
    """A binding that does not parse; caught when a declaration is read, long before any failure."""

    def __init__(self, expression: str, reason: str, template: str | None = None) -> None:
        super().__init__(expression, reason, template)
        self.expression = expression
        self.reason = reason
        self.template = template

    def __str__(self) -> str:
        where = f" (in template {self.template!r})" if self.template is not None else ""
        return f"`{self.expression}`: {self.reason}{where}"


class UnresolvableError(Exception):
    """A binding that parses but cannot be resolved against a stored call: recovery is unavailable."""

    def __init__(self, expression: str, reason: str, parameter: str | None = None) -> None:
        super().__init__(expression, reason, parameter)
        self.expression = expression
        self.reason = reason
        self.parameter = parameter

    def __str__(self) -> str:
        prefix = f"parameter {self.parameter!r}: " if self.parameter is not None else ""
        return f"{prefix}`{self.expression}`: {self.reason}"


class Constant(msgspec.Struct, frozen=True):
    value: Any


class Expression(msgspec.Struct, frozen=True):
    source: str
    kind: Kind
    pointer: tuple[str, ...] = ()
    name: str | None = None


class Template(msgspec.Struct, frozen=True):
    parts: tuple[str | Expression, ...]


class Structure(msgspec.Struct, frozen=True):
    """An array (`keys` None) or object with a binding somewhere inside, resolved member by member."""

    members: tuple[Binding, ...]
    keys: tuple[str, ...] | None = None


Binding = Constant | Expression | Template | Structure
# The same four as a tuple: `isinstance` with the `|` expression would build three union objects per call.
_BINDINGS = (Constant, Expression, Template, Structure)


def parse_value(value: Any) -> Binding:
    """Parse one `parameters` value, looking inside arrays and objects at any depth.

    An array or object without any expression inside stays one constant, exactly as declared.
    """
    if isinstance(value, _BINDINGS):
        return value
    if isinstance(value, str):
        return _parse_text(value)
    if isinstance(value, list | tuple):
        members = tuple(parse_value(item) for item in value)
        keys = None
    elif isinstance(value, dict):
        keys = tuple(value)
        members = tuple(parse_value(item) for item in value.values())
    else:
        return Constant(value)
    if all(isinstance(member, Constant) for member in members):
        return Constant(value)
    return Structure(members, keys)


@functools.lru_cache(maxsize=4096)
def _parse_text(value: str) -> Binding:
    """Cached: the same few declarations are resolved for every step of every workflow."""
    if value.startswith("$"):
        return _parse_expression(value)
    if "{$" in value:
        return _parse_template(value)
    return Constant(value)


def _parse_template(text: str) -> Template:
    parts: list[str | Expression] = []
    pos = 0
    while (start := text.find("{$", pos)) != -1:
        end = text.find("}", start)
        if end == -1:
            raise ExpressionError(text[start:], "embedded expression has no closing '}'", text)
        if start > pos:
            parts.append(text[pos:start])
        parts.append(_parse_expression(text[start + 1 : end], template=text))
        pos = end + 1
    if pos < len(text):
        parts.append(text[pos:])
    return Template(tuple(parts))


def _parse_expression(source: str, template: str | None = None) -> Expression:
    def fail(reason: str) -> ExpressionError:
        return ExpressionError(source, reason, template)

    if source in _NO_COUNTERPART:
        raise fail(_NO_COUNTERPART[source])
    scope, dot, rest = source.partition(".")
    if scope not in ("$request", "$response") or not dot:
        raise fail(f"not a runtime expression ({_EXPECTED})")
    side = scope[1:]
    if rest == "body" or rest.startswith("body#"):
        try:
            pointer = parse_pointer(rest[5:])
        except PointerError as exc:
            raise fail(str(exc)) from None
        return Expression(source, "request.body" if side == "request" else "response.body", pointer)
    if rest.startswith("body"):
        raise fail("a body pointer follows '#', e.g. $response.body#/id")
    location, _, name = rest.partition(".")
    if location in ("query", "path"):
        raise fail(f"MCP tool calls have no {location} parameters (use $request.body#/... for arguments)")
    if location == "header" and side == "request":
        raise fail("MCP requests have no headers (use $request.body#/... for arguments)")
    if location == "header":
        if not _HEADER_NAME.fullmatch(name):
            raise fail(f"{name!r} is not a header name (a _meta key: letters, digits, !#$%&'*+-.^_`|~/)")
        return Expression(source, "response.header", name=name)
    raise fail(f"unknown source {rest!r} ({_EXPECTED})")


def response_body(result: dict[str, Any]) -> Any:
    """What `$response.body` means for a CallToolResult: structured content when the tool gave
    it, else the text it returned if that is JSON. Never guess beyond that."""
    if not isinstance(result, dict):
        raise UnresolvableError("$response.body", f"the stored result is {json_type(result)}, not an object")
    if result.get("isError"):
        raise UnresolvableError("$response.body", "the call failed (isError is true)")
    if result.get("structuredContent") is not None:
        return result["structuredContent"]
    texts = text_blocks(result)
    if len(texts) != 1:
        found = "no text content block" if not texts else f"{len(texts)} text content blocks"
        raise UnresolvableError("$response.body", f"no structuredContent and {found} (need exactly one)")
    if not isinstance(texts[0], str):
        raise UnresolvableError("$response.body", "the text content block has no text")
    try:
        # msgspec, not json.loads: strict JSON, so no NaN (it would be sent on as null) and no lone
        # surrogate (it cannot be stored), and absurd nesting is an error here, not a crash later.
        return msgspec.json.decode(texts[0])
    except (msgspec.DecodeError, RecursionError) as exc:
        raise UnresolvableError("$response.body", f"no structuredContent and the text is not JSON ({exc})") from None


def _evaluate(expr: Expression, arguments: dict[str, Any], result: dict[str, Any]) -> Any:
    try:
        return _read(expr, arguments, result)
    except UnresolvableError as exc:
        meta = result.get("_meta") if isinstance(result, dict) else None
        cut = meta.get(CUT_META_KEY) if isinstance(meta, dict) else None
        if not isinstance(cut, dict) or (expr.kind == "request.body" and not cut.get("argumentsCut")):
            raise
        kept = ", ".join(str(p) for p in cut.get("kept") or ()) or "nothing"
        raise UnresolvableError(
            expr.source,
            f"{exc.reason}; the recorded step of {cut.get('tool')!r} was cut from {cut.get('bytes')} bytes to fit"
            f" the {cut.get('cap')}-byte event cap (kept: {kept})",
        ) from None


def _read(expr: Expression, arguments: dict[str, Any], result: dict[str, Any]) -> Any:
    if expr.kind == "response.header":
        meta = result.get("_meta") if isinstance(result, dict) else None
        if not isinstance(meta, dict):
            raise UnresolvableError(expr.source, "the result has no _meta")
        if expr.name not in meta:
            raise UnresolvableError(expr.source, f"_meta has no key {expr.name!r}")
        return meta[expr.name]
    if expr.kind == "request.body":
        doc = arguments
    else:
        try:
            doc = response_body(result)
        except UnresolvableError as exc:
            raise UnresolvableError(expr.source, exc.reason) from None
    try:
        return select(doc, expr.pointer)
    except PointerError as exc:
        raise UnresolvableError(expr.source, str(exc)) from None


def select(doc: Any, tokens: tuple[str, ...], at: tuple[str, ...] = ()) -> Any:
    """`resolve_pointer`, plus the `*` projection: every item of an array, in order."""
    if WILDCARD not in tokens:
        try:
            return resolve_pointer(doc, tokens)
        except PointerError as exc:
            raise PointerError(exc.reason, format_pointer(at) + (exc.at or "")) from None
    star = tokens.index(WILDCARD)
    node = select(doc, tokens[:star], at)
    here, rest = (*at, *tokens[:star]), tokens[star + 1 :]
    if isinstance(node, dict):  # RFC 6901: on an object, "*" is just a key
        if WILDCARD not in node:
            raise PointerError(f"key {WILDCARD!r} missing", format_pointer((*here, WILDCARD)))
        return select(node[WILDCARD], rest, (*here, WILDCARD))
    if not isinstance(node, list):
        raise PointerError(f"'*' projects an array, not {json_type(node)}", format_pointer((*here, WILDCARD)))
    return [select(item, rest, (*here, str(i))) for i, item in enumerate(node)]


def _render(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def resolve_value(binding: Any, *, arguments: dict[str, Any], result: dict[str, Any]) -> Any:
    """Accepts a parsed binding or a raw declaration value; raw values that do not parse raise
    ExpressionError."""
    binding = parse_value(binding)
    if isinstance(binding, Constant):
        return binding.value
    if isinstance(binding, Expression):
        return _evaluate(binding, arguments, result)
    if isinstance(binding, Structure):
        values = [resolve_value(member, arguments=arguments, result=result) for member in binding.members]
        return values if binding.keys is None else dict(zip(binding.keys, values, strict=True))
    return "".join(
        part if isinstance(part, str) else _render(_evaluate(part, arguments, result)) for part in binding.parts
    )


def resolve_parameters(
    parameters: dict[str, Any], *, arguments: dict[str, Any], result: dict[str, Any]
) -> dict[str, Any]:
    """All or nothing. A binding that does not parse is reported as unresolvable too: for the
    caller both mean the same thing, recovery is unavailable for this step."""
    resolved: dict[str, Any] = {}
    for name, raw in parameters.items():
        try:
            resolved[name] = resolve_value(raw, arguments=arguments, result=result)
        except (UnresolvableError, ExpressionError) as exc:
            raise UnresolvableError(exc.expression, exc.reason, parameter=name) from None
    return resolved


Resolver = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
# What a compiled getter reads: the call's arguments, its result, and a one-slot cache of the body.
_Getter = Callable[[dict[str, Any], dict[str, Any], list[Any]], Any]


class _Fallback(Exception):
    """A compiled getter met something other than the common case: resolve_parameters decides."""


def compile_parameters(parameters: dict[str, Any]) -> Resolver:
    """`resolve_parameters` for one declaration, prepared once: `resolver(arguments, result)`.

    The coordinator plans every step of a tool with the same declaration, and reading the
    declaration again for each step (parse, dispatch on the binding's shape, walk the pointer
    through generic checks, parse the response body once per expression) was most of what a
    recorded step cost it. The compiled form keeps only the walk over plain JSON objects and
    arrays, and computes the body once per call. Whatever it does not expect (a key or index that
    is missing, a failed call, a body from text, anything but a dict or list on the way) makes it
    hand the whole set to `resolve_parameters`, so the result, and every error and its wording,
    stays that function's.
    """
    try:
        getters = [(name, _compile(parse_value(raw))) for name, raw in parameters.items()]
    except ExpressionError:
        getters = None

    def resolve(arguments: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        if getters is not None:
            body: list[Any] = []
            try:
                return {name: get(arguments, result, body) for name, get in getters}
            except _Fallback:
                pass
        return resolve_parameters(parameters, arguments=arguments, result=result)

    return resolve


def _compile(binding: Binding) -> _Getter:
    if isinstance(binding, Constant):
        value = binding.value
        return lambda arguments, result, body: value
    if isinstance(binding, Expression):
        return _compile_expression(binding)
    if isinstance(binding, Structure):
        members = [_compile(member) for member in binding.members]
        keys = binding.keys
        if keys is None:
            return lambda arguments, result, body: [get(arguments, result, body) for get in members]
        pairs = list(zip(keys, members, strict=True))
        return lambda arguments, result, body: {key: get(arguments, result, body) for key, get in pairs}
    parts = [part if isinstance(part, str) else _compile_expression(part) for part in binding.parts]
    return lambda arguments, result, body: "".join(
        [part if type(part) is str else _render(part(arguments, result, body)) for part in parts]
    )


def _compile_expression(expr: Expression) -> _Getter:
    if expr.kind == "response.header":
        name = expr.name

        def header(arguments: dict[str, Any], result: dict[str, Any], body: list[Any]) -> Any:
            meta = result.get("_meta") if type(result) is dict else None
            if type(meta) is not dict or name not in meta:
                raise _Fallback
            return meta[name]

        return header
    walk = _compile_pointer(expr.pointer)
    if expr.kind == "request.body":
        return lambda arguments, result, body: walk(arguments)

    def response(arguments: dict[str, Any], result: dict[str, Any], body: list[Any]) -> Any:
        if not body:
            body.append(_plain_body(result))
        return walk(body[0])

    return response


def _plain_body(result: dict[str, Any]) -> Any:
    """`response_body` when it is the result's structured content; anything else falls back."""
    if type(result) is not dict or result.get("isError"):
        raise _Fallback
    found = result.get("structuredContent")
    if found is None:
        raise _Fallback
    return found


def _compile_pointer(tokens: tuple[str, ...]) -> Callable[[Any], Any]:
    """The walk of `select` for plain objects and arrays (with `*`: `select` itself)."""
    if WILDCARD in tokens:

        def project(doc: Any) -> Any:
            try:
                return select(doc, tokens)
            except PointerError:
                raise _Fallback from None

        return project
    # Per token, the index it names in an array (None: it names none, RFC 6901 section 4).
    steps = [(token, int(token) if ARRAY_INDEX.fullmatch(token) else None) for token in tokens]

    def walk(doc: Any) -> Any:
        node = doc
        for token, index in steps:
            kind = type(node)
            if kind is dict:
                if token not in node:
                    raise _Fallback
                node = node[token]
            elif kind is list and index is not None and index < len(node):
                node = node[index]
            else:
                raise _Fallback
        return node

    return walk


def referenced_pointers(parameters: dict[str, Any]) -> list[tuple[str, Kind, tuple[str, ...]]]:
    """Every expression a declaration uses, for checking against schemas before any call exists.
    For `response.header` the single token is the `_meta` key."""
    found: list[tuple[str, Kind, tuple[str, ...]]] = []
    for name, raw in parameters.items():
        for part in expressions_in(parse_value(raw)):
            tokens = (part.name or "",) if part.kind == "response.header" else part.pointer
            found.append((name, part.kind, tokens))
    return found


def keep_only(doc: Any, pointers: list[tuple[str, ...]]) -> Any:
    """`doc` cut down to what the pointers read (with `*`), in the same places: every pointer that
    resolves against `doc` resolves to the same value against the result. An array keeps its
    length up to the last index read, with null in the places nothing reads."""
    mask: Any = None
    for tokens in pointers:
        mask = _merge(mask, _mask(tokens))
    return _apply(doc, mask) if mask is not None else None


def _mask(tokens: tuple[str, ...]) -> Any:
    mask: Any = True
    for token in reversed(tokens):
        mask = {token: mask}
    return mask


def _merge(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if a is True or b is True:
        return True
    return {key: _merge(a.get(key), b.get(key)) for key in a.keys() | b.keys()}


def _apply(node: Any, mask: Any) -> Any:
    if mask is True:
        return node
    if isinstance(node, dict):
        return {key: _apply(node[key], sub) for key, sub in mask.items() if key in node}
    if isinstance(node, list):
        every = mask.get(WILDCARD)
        indices = {int(key): sub for key, sub in mask.items() if key.isdigit() and int(key) < len(node)}
        if every is not None:
            return [_apply(item, _merge(every, indices.get(i))) for i, item in enumerate(node)]
        kept = [None] * (max(indices) + 1 if indices else 0)
        for i, sub in indices.items():
            kept[i] = _apply(node[i], sub)
        return kept
    return node


def expressions_in(binding: Binding) -> list[Expression]:
    """Every expression of a binding, however deep, in declaration order."""
    if isinstance(binding, Expression):
        return [binding]
    if isinstance(binding, Template):
        return [part for part in binding.parts if isinstance(part, Expression)]
    if isinstance(binding, Structure):
        return [expr for member in binding.members for expr in expressions_in(member)]
    return []
