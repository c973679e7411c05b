"""RFC 6901 JSON Pointer, the addressing half of `$response.body#/...` bindings.

Pointers are kept as tuples of unescaped tokens so that a key containing `/` or `~` is never
confused with a path separator. Resolution errors carry the pointer prefix where the walk stopped:
an operator reading "key 'id' missing at /order/id" knows which part of a stored response was
absent without re-running anything.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# RFC 6901 section 4: an array index is "0" or a decimal without leading zeros; "-" names the
# (nonexistent) element after the last one and never resolves.
ARRAY_INDEX = re.compile(r"0|[1-9][0-9]*")
_BAD_TILDE = re.compile(r"~(?![01])")
# The array projection of our runtime expressions (schemas/expressions.py): never an RFC 6901 index.
WILDCARD = "*"


class PointerError(ValueError):
    """A pointer that does not parse, or does not resolve; `at` is where the walk stopped."""

    def __init__(self, reason: str, at: str | None = None) -> None:
        super().__init__(reason, at)
        self.reason = reason
        self.at = at

    def __str__(self) -> str:
        return self.reason if self.at is None else f"{self.reason} at {self.at}"


def escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def unescape(token: str) -> str:
    """Reject a bare `~`: guessing what it meant could silently address another key."""
    if _BAD_TILDE.search(token):
        raise PointerError(f"{token!r}: '~' must be followed by '0' or '1'")
    # "~1" first, so that "~01" decodes to "~1" and not to "/".
    return token.replace("~1", "/").replace("~0", "~")


def parse_pointer(text: str) -> tuple[str, ...]:
    if text == "":
        return ()
    if not text.startswith("/"):
        raise PointerError(f"{text!r} is not a JSON pointer: it must be empty or start with '/'")
    return tuple(unescape(token) for token in text[1:].split("/"))


def format_pointer(tokens: Iterable[str]) -> str:
    return "".join("/" + escape(token) for token in tokens)


def resolve_pointer(doc: Any, tokens: Iterable[str]) -> Any:
    tokens = tuple(tokens)
    node = doc
    for depth, token in enumerate(tokens):
        if isinstance(node, Mapping):
            if token not in node:
                raise PointerError(f"key {token!r} missing", format_pointer(tokens[: depth + 1]))
            node = node[token]
        elif isinstance(node, list | tuple):
            node = node[_index(token, len(node), tokens[: depth + 1])]
        else:
            raise PointerError(f"cannot look up {token!r} in {json_type(node)}", format_pointer(tokens[: depth + 1]))
    return node


def _index(token: str, length: int, path: tuple[str, ...]) -> int:
    """The array index a token names; the path (formatted only for an error) says where."""
    if token == "-":
        raise PointerError("'-' (past the last element) never resolves", format_pointer(path))
    if not ARRAY_INDEX.fullmatch(token):
        why = " (leading zero)" if token[:1] == "0" and token.isascii() and token.isdigit() else ""
        raise PointerError(f"{token!r} is not an array index{why}", format_pointer(path))
    index = int(token)
    if index >= length:
        raise PointerError(f"index {index} out of range (length {length})", format_pointer(path))
    return index


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages read by people who only see the JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return f"a {type(value).__name__}"
