"""Tables that fit the console without breaking a word: narrower than a table, its headers break
after ``_`` (``example_`` over ``id``), then its columns continue in further tables below."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table

UNBOUNDED = 1 << 30  # columns to measure a table in: its natural width, not one cut to fit


def _stacked(name: str) -> str:
    """A column name on as few lines as its longest ``_``-separated part allows: ``example_`` /
    ``id``; a name without ``_`` stays whole."""
    parts = [p + "_" for p in name.split("_")]
    parts[-1] = parts[-1][:-1]
    width = max(map(len, parts))
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)


@dataclass
class FittedTable:
    """Rows of text cells under named columns, rendered as one rich ``Table`` when it fits the
    width, else with stacked headers, else as several tables that each repeat the first ``keep``
    columns (the row's ids). ``title`` goes over the first, ``caption`` under the last."""

    columns: dict[str, list[str]]  # name -> cells, right-justified
    title: str | None = None
    caption: str | None = None
    keep: int = 1
    options: dict[str, Any] = field(default_factory=dict)  # more Table arguments (show_edge)

    def _table(
        self, names: list[str], stacked: bool, first: bool, last: bool, width: int = 0
    ) -> Table:
        """One table; at least as wide as its title and caption, up to ``width``, so that a
        table narrower than its words does not break them over lines."""
        title, caption = self.title if first else None, self.caption if last else None
        words = max(len(title or ""), len(caption or ""))
        return self._filled(Table(title=title, caption=caption, min_width=min(words, width),
                                  **self.options), names, stacked)  # fmt: skip

    def _filled(self, table: Table, names: list[str], stacked: bool) -> Table:
        for name in names:
            table.add_column(_stacked(name) if stacked else name, justify="right", overflow="fold")
        for row in zip(*(self.columns[n] for n in names), strict=True):
            table.add_row(*row)
        return table

    def _blocks(self, width: int, fits) -> list[list[str]]:
        """The columns in groups that fit ``width``, each led by the kept columns."""
        names = list(self.columns)
        kept, rest = names[: self.keep], names[self.keep :]
        blocks = [[*kept]]
        for name in rest:
            if len(blocks[-1]) > len(kept) and not fits([*blocks[-1], name]):
                blocks.append([*kept])
            blocks[-1].append(name)
        return blocks

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, unbounded = options.max_width, options.update(width=UNBOUNDED)

        def fits(names: list[str], stacked: bool = True) -> bool:
            table = self._table(names, stacked, True, True)
            return Measurement.get(console, unbounded, table).maximum <= width

        names = list(self.columns)
        for stacked in (False, True):
            if fits(names, stacked):
                yield self._table(names, stacked, True, True, width)
                return
        blocks = self._blocks(width, fits)
        for n, block in enumerate(blocks):
            yield self._table(block, True, n == 0, n == len(blocks) - 1, width)


def fmt(value: object) -> str:
    """A cell as text: floats to 4 significant digits, numpy scalars as Python values."""
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    if isinstance(value, (np.integer, np.bool_)):
        return str(value.item())
    return str(value)
