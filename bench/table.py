"""One row format and one table for every benchmark, so `python -m bench` prints them together."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Row:
    """A measured figure beside the baseline it is judged against, in the same run."""

    name: str
    value: float
    baseline: float | None
    target: str
    met: bool | None
    # The median of paired rounds' own ratios, where a bench pairs them: under load it is steadier than
    # the ratio of the two medians, so it is the ratio shown. `spread`: those ratios' quartiles (of the
    # value itself when there is no baseline).
    paired: float | None = None
    spread: tuple[float, float] | None = None

    @property
    def ratio(self) -> float | None:
        if self.paired is not None:
            return self.paired
        return self.value / self.baseline if self.baseline else None

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"ratio": self.ratio}


def print_table(rows: list[Row], title: str, console: Console | None = None) -> None:
    table = Table(title=title)
    for column in ("measure", "value", "baseline", "ratio", "target", "met"):
        table.add_column(column, justify="left" if column in ("measure", "target") else "right")
    for row in rows:
        table.add_row(
            row.name,
            _fmt(row.value),
            "" if row.baseline is None else _fmt(row.baseline),
            _ratio(row),
            row.target,
            {True: "[green]yes[/]", False: "[red]no[/]", None: ""}[row.met],
        )
    (console or Console()).print(table)


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _ratio(row: Row) -> str:
    if row.ratio is None:  # a figure with no baseline may still have a spread: its own quartiles
        return f"({_fmt(row.spread[0])} to {_fmt(row.spread[1])})" if row.spread else ""
    return f"{row.ratio:.2f}" + (f" ({row.spread[0]:.2f}-{row.spread[1]:.2f})" if row.spread else "")
