"""Output for the ops commands: rich tables for people, JSON for scripts.

Every value shown comes from Redis and may hold anything a publisher wrote, so cells are built as
`Text` (never parsed as rich markup) and long values are cut to keep a table readable; `--json`
gives the full values.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def console() -> Console:
    """A console bound to the current stdout; wide when piped, so `grep` sees whole rows."""
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200, highlight=False)


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str, ensure_ascii=False))


def text(value: Any, limit: int = 0) -> str:
    """One-line text of a value; dicts and lists as compact JSON."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False)
    value = " ".join(value.split())
    return value[: limit - 1] + "…" if limit and len(value) > limit else value


def when(ts: float | str | None) -> str:
    """Local time with milliseconds: a timeline is read at that resolution."""
    try:
        seconds = float(ts or 0)
    except ValueError:
        return text(ts)
    if seconds <= 0:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}"


def table(title: str | None, columns: str, rows: Iterable[Sequence[Any]], **options: Any) -> Table:
    """`columns` is one comma-separated string ("#, step, status"), which keeps call sites to a line."""
    out = Table(title=title, title_justify="left", title_style="bold", **options)
    for column in columns.split(", "):
        out.add_column(column, overflow="fold")
    for row in rows:
        out.add_row(*(Text(text(cell)) for cell in row))
    return out


def pairs(title: str | None, items: Iterable[tuple[str, Any]], *, skip_empty: bool = True) -> Table:
    """A two-column name/value table, for records that are one object; unset fields left out."""
    out = Table(title=title, title_justify="left", title_style="bold", show_header=False, box=None, padding=(0, 2))
    out.add_column(style="bold")
    out.add_column(overflow="fold")
    for name, value in items:
        if not skip_empty or value not in (None, "", 0, 0.0, False):
            out.add_row(Text(name), Text(text(value)))
    return out
