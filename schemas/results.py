"""The text of a CallToolResult, defined once: what a failed call said, what a person reads.

A result arrives in two shapes: the wire form (a dict with camelCase keys, as events and reports
carry it) and the SDK's pydantic model (what `Client.call_tool` returns to an agent). Both have a
`content` list whose `text` blocks hold what the tool said; everything that shows or classifies
that text (the worker's error classification, the SDK's `ToolCallFailed`, `$response.body`'s
single-text-block rule, `saga inspect`, the demo) reads it through here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def text_blocks(result: Any) -> list[Any]:
    """The `text` of every content block of type "text", in order (not checked to be strings)."""
    content = result.get("content") if isinstance(result, Mapping) else getattr(result, "content", None)
    texts = []
    for block in content if isinstance(content, list) else ():
        if isinstance(block, Mapping):
            kind, text = block.get("type"), block.get("text")
        else:
            kind, text = getattr(block, "type", None), getattr(block, "text", None)
        if kind == "text":
            texts.append(text)
    return texts


def result_text(result: Any, separator: str = " ") -> str:
    """The result's text blocks joined, blank ones left out; "" when it has none."""
    return separator.join(t for t in text_blocks(result) if isinstance(t, str) and t).strip()


def result_summary(result: Any) -> str:
    """What a person looks for in a step's result (`saga inspect`, the console): its structured body
    as compact JSON, else its text; "error: " first when the call failed.

    Whole: each view cuts it to its own width.
    """
    if not isinstance(result, Mapping):
        return _compact(result)
    body = result.get("structuredContent")
    text = result_text(result) if body is None else _compact(body)
    return ("error: " if result.get("isError") else "") + text


def _compact(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
