from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp_saga.schemas.pointer import PointerError, escape, format_pointer, parse_pointer, resolve_pointer, unescape

# The example document of RFC 6901 section 5.
RFC_DOC = {
    "foo": ["bar", "baz"],
    "": 0,
    "a/b": 1,
    "c%d": 2,
    "e^f": 3,
    "g|h": 4,
    "i\\j": 5,
    'k"l': 6,
    " ": 7,
    "m~n": 8,
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=10,
)


@pytest.mark.parametrize(
    ("token", "escaped"),
    [("a/b", "a~1b"), ("m~n", "m~0n"), ("~1", "~01"), ("/~", "~1~0"), ("", ""), ("plain", "plain")],
)
def test_escape_and_unescape_follow_rfc_6901(token: str, escaped: str) -> None:
    assert escape(token) == escaped
    assert unescape(escaped) == token


def test_unescape_decodes_tilde_one_after_tilde_zero() -> None:
    assert unescape("~01") == "~1"
    assert unescape("~10") == "/0"


@pytest.mark.parametrize("token", ["~", "a~", "~2", "~a", "x~~0"])
def test_unescape_rejects_a_tilde_not_followed_by_0_or_1(token: str) -> None:
    with pytest.raises(PointerError, match="'~' must be followed by '0' or '1'"):
        unescape(token)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", ()),
        ("/", ("",)),
        ("/foo", ("foo",)),
        ("/foo/0", ("foo", "0")),
        ("/a~1b", ("a/b",)),
        ("/m~0n", ("m~n",)),
        ("//x/", ("", "x", "")),
    ],
)
def test_parse_pointer_splits_and_unescapes(text: str, tokens: tuple[str, ...]) -> None:
    assert parse_pointer(text) == tokens
    assert format_pointer(tokens) == text


@pytest.mark.parametrize("text", ["foo", "#/foo", " /foo"])
def test_parse_pointer_requires_a_leading_slash(text: str) -> None:
    with pytest.raises(PointerError, match="must be empty or start with '/'"):
        parse_pointer(text)


def test_parse_pointer_rejects_a_bad_escape() -> None:
    with pytest.raises(PointerError, match="'~' must be followed"):
        parse_pointer("/a/b~")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", RFC_DOC),
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_resolve_pointer_on_the_rfc_examples(text: str, expected: Any) -> None:
    assert resolve_pointer(RFC_DOC, parse_pointer(text)) == expected


def test_resolve_pointer_walks_nested_objects_and_arrays() -> None:
    doc = {"orders": [{"id": "A"}, {"id": "B", "lines": [10, 20, 30]}]}
    assert resolve_pointer(doc, ("orders", "1", "lines", "2")) == 30
    assert resolve_pointer(doc, ("orders", "0")) == {"id": "A"}


def test_resolve_pointer_keeps_falsy_values() -> None:
    doc = {"zero": 0, "none": None, "empty": "", "no": False}
    assert [resolve_pointer(doc, (key,)) for key in doc] == [0, None, "", False]


def test_missing_key_names_the_key_and_where() -> None:
    with pytest.raises(PointerError) as caught:
        resolve_pointer({"order": {"id": 1}}, ("order", "total"))
    assert str(caught.value) == "key 'total' missing at /order/total"
    assert caught.value.at == "/order/total"


def test_index_out_of_range_says_the_length() -> None:
    with pytest.raises(PointerError) as caught:
        resolve_pointer({"foo": ["bar", "baz"]}, ("foo", "2"))
    assert str(caught.value) == "index 2 out of range (length 2) at /foo/2"


@pytest.mark.parametrize("token", ["01", "00", "007"])
def test_leading_zero_indices_do_not_resolve(token: str) -> None:
    with pytest.raises(PointerError, match=r"is not an array index \(leading zero\) at /foo/"):
        resolve_pointer({"foo": list(range(10))}, ("foo", token))


def test_dash_never_resolves() -> None:
    with pytest.raises(PointerError, match=r"'-' \(past the last element\) never resolves at /foo/-"):
        resolve_pointer({"foo": [1, 2]}, ("foo", "-"))


@pytest.mark.parametrize("token", ["x", "-1", "1.0", " 1", "\u0661"])
def test_non_decimal_array_tokens_do_not_resolve(token: str) -> None:
    with pytest.raises(PointerError, match="is not an array index"):
        resolve_pointer([0, 1, 2], (token,))


def test_dash_is_an_ordinary_key_in_an_object() -> None:
    assert resolve_pointer({"-": 1, "01": 2}, ("-",)) == 1
    assert resolve_pointer({"-": 1, "01": 2}, ("01",)) == 2


@pytest.mark.parametrize(
    ("doc", "kind"),
    [("text", "a string"), (3, "a number"), (1.5, "a number"), (True, "a boolean"), (None, "null")],
)
def test_scalars_are_not_containers(doc: Any, kind: str) -> None:
    with pytest.raises(PointerError) as caught:
        resolve_pointer({"a": doc}, ("a", "b"))
    assert str(caught.value) == f"cannot look up 'b' in {kind} at /a/b"


def test_error_position_uses_escaped_tokens() -> None:
    with pytest.raises(PointerError) as caught:
        resolve_pointer({"a/b": {}}, ("a/b", "m~n"))
    assert caught.value.at == "/a~1b/m~0n"


@given(st.text())
def test_escape_round_trips_and_removes_slashes(token: str) -> None:
    escaped = escape(token)
    assert "/" not in escaped
    assert unescape(escaped) == token


@given(st.lists(st.text()))
def test_format_and_parse_round_trip(tokens: list[str]) -> None:
    assert parse_pointer(format_pointer(tokens)) == tuple(tokens)


path_steps = st.lists(
    st.one_of(st.text().map(lambda key: ("key", key)), st.integers(0, 4).map(lambda i: ("index", i))),
    max_size=6,
)


def build_document(path: list[tuple[str, Any]], leaf: Any, filler: Any) -> tuple[Any, tuple[str, ...]]:
    """A document holding `leaf` at `path`, with `filler` around it so that the walk has to choose."""
    node = leaf
    for kind, step in reversed(path):
        node = {"~sibling/": filler, step: node} if kind == "key" else [filler] * step + [node, filler]
    return node, tuple(str(step) for _, step in path)


@given(path_steps, json_values, json_values)
def test_resolving_a_random_path_returns_the_value_placed_there(
    path: list[tuple[str, Any]], leaf: Any, filler: Any
) -> None:
    doc, tokens = build_document(path, leaf, filler)
    assert resolve_pointer(doc, tokens) == leaf
    assert resolve_pointer(doc, parse_pointer(format_pointer(tokens))) == leaf
