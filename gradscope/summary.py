"""The outlier tables of a scores file as the terminal shows them: the score's histogram on one
line, the top-k rows at each end, the per-class table and a one-paragraph summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text

from .io.scorefile import column
from .outliers import End, Outliers, bin_edges, is_labels, per_class, rank
from .tables import FittedTable, fmt

BARS = "▁▂▃▄▅▆▇█"
SPARK_BINS = 40


def sparkline(found: Outliers, plain: bool = False) -> Text:
    """The score's histogram on one line, heights by log count; bins holding a top-k row red,
    or, ``plain`` (no colour shown), marked ``^`` on a second line."""
    finite = found.values[found.ok]
    if not len(finite):
        return Text(f"{found.score}: no finite values")
    counts, edges = np.histogram(finite, bins=bin_edges(finite, SPARK_BINS))
    marked = set(np.clip(np.searchsorted(edges, found.values[found.top], "right") - 1, 0,
                         SPARK_BINS - 1).tolist())  # fmt: skip
    line = Text(f"{found.score} {fmt(edges[0])} ")
    indent = " " * len(line)
    for i, count in enumerate(counts):
        # log heights: the tail's few examples stay visible beside the bulk
        level = min(len(BARS) - 1, int(len(BARS) * np.log1p(count) / np.log1p(counts.max())))
        line.append(BARS[level] if count else " ", style="red" if i in marked else "cyan")
    top = f"top {len(found.ends[0].top)}{' at each end' if len(found.ends) > 1 else ''}"
    if not plain:
        return line.append(f" {fmt(edges[-1])}  red: {top}")
    marks = "".join("^" if i in marked else " " for i in range(SPARK_BINS))
    return line.append(f" {fmt(edges[-1])}\n{indent}{marks}  ^: the bins holding the {top}")


@dataclass
class Histogram:
    """The sparkline as the console can show it: the top-k bins red where colour shows, marked
    on a line of their own where it does not (a log, a pipe, NO_COLOR)."""

    found: Outliers

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield sparkline(self.found, plain=console.no_color or console.color_system is None)


def _outlier_table(found: Outliers, end: End) -> FittedTable:
    caption = "robust_z = (x - median) / (1.4826 MAD)"
    if "class_z" in end.rows:
        caption += "; class_z: the same within its target class"
    names = list(end.rows)
    columns = {name: [cell(found, name, v) for v in end.rows[name]] for name in names}
    return FittedTable(
        columns,
        title=f"top {len(end.top)} outliers by {found.score}, {end.label}",
        caption=caption,
        keep=len([n for n in names[:3] if n in ("example_id", "ref_id", "id")]),
        options={"show_edge": False},  # the prediction columns need the room in 80 columns
    )


def cell(found: Outliers, name: str, value: object) -> str:
    """A table cell: class ids by name in ``target`` and ``pred``."""
    return found.class_name(value) if name in ("target", "pred") else fmt(value)


def _class_table(found: Outliers) -> FittedTable:
    classes = per_class(found)
    names = list(classes)
    cells = [list(classes[names[0]]), [str(n) for n in classes[names[1]]],
             [fmt(v) for v in classes[names[2]]]]  # fmt: skip
    cells += [[f"{share:.0%}" for share in classes[name]] for name in names[3:]]
    return FittedTable(dict(zip(names, cells, strict=True)), title=f"per class ({found.score})")


def summarize(
    path: str | Path, by: str | None = None, k: int = 20, classes: list[str] | None = None
) -> Group:
    """The outlier tables, the per-class table and the summary paragraph of a scores file."""
    found = rank(path, by, k, classes)
    parts: list[object] = [Histogram(found), *(_outlier_table(found, e) for e in found.ends)]
    if is_labels(found.target):
        parts.append(_class_table(found))
    unit = "(example, reference) pairs" if "ref_id" in found.names else "examples"
    values, ok = found.values, found.ok
    extremes = "max -"
    if ok.any():  # a signed score's lower end matters as much as its upper
        smallest, largest = values[ok].min(), values[ok].max()
        extremes = (f"min {fmt(smallest)}, " if smallest < 0 else "") + f"max {fmt(largest)}"
    parts.append(
        Text(
            f"{len(values)} {unit}; {found.score}: median {fmt(found.spread.median)}, "
            f"MAD {fmt(found.spread.mad)}, {extremes}; {int((~ok).sum())} non-finite."
        )
    )
    empty = uncounted(found)
    if empty:
        parts.append(
            Text(
                f"{empty} of them count no target (every target ignore_index): their loss is NaN "
                "and their gradient zero, and no ranking takes them."
            )
        )
    return Group(*parts)


def uncounted(found: Outliers) -> int:
    """How many rows count no target: the scorers write NaN for their loss (a mean over
    nothing), beside an exact zero gradient; a row whose NaN came from the model has a NaN
    gradient too."""
    names = set(found.names)
    if found.ok.all() or not {"loss", "grad_norm"} <= names:
        return 0
    bad = ~found.ok  # kept for the unranked rows alone
    loss, norm = (column(found.file, n)[bad] for n in ("loss", "grad_norm"))
    return int((np.isnan(loss) & (norm == 0)).sum())
