"""Outlier tables from a scores file: top-k by robust z, per class, and a one-paragraph summary.

Only the ranked column, `finite` and `target` are held for every row (about 17 bytes a row); the
other columns are read for the top-k rows alone, row group by row group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .errors import DataError

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MAX_CLASSES = 100  # above this many distinct targets, the targets are not class labels
SHOWN = (
    "example_id", "ref_id", "id", "loss", "grad_norm", "self_influence", "influence", "cosine",
    "target", "pred", "prob", "margin",
)  # fmt: skip
BARS = "▁▂▃▄▅▆▇█"
SPARK_BINS = 40


@dataclass
class Spread:
    """Median and MAD of the finite values of a score, and the robust z they define."""

    median: float
    mad: float

    @classmethod
    def of(cls, values: np.ndarray) -> Spread:
        median = float(np.median(values)) if len(values) else float("nan")
        return cls(median, float(np.median(np.abs(values - median))) if len(values) else 0.0)

    def z(self, values: np.ndarray) -> np.ndarray:
        """(x - median) / (1.4826 MAD); with MAD 0 (most values equal), x - median itself."""
        scale = MAD_TO_SIGMA * self.mad
        return (values - self.median) / (scale if scale > 0 else 1.0)


def column(file: pq.ParquetFile, name: str) -> np.ndarray:
    """One column as a numpy array, read row group by row group."""
    parts = [
        file.read_row_group(i, columns=[name]).column(0).to_numpy()
        for i in range(file.num_row_groups)
    ]
    return np.concatenate(parts) if parts else np.empty(0)


def rows_at(file: pq.ParquetFile, positions: np.ndarray, columns: list[str]) -> pd.DataFrame:
    """The rows at ``positions`` (in that order), reading only the row groups that hold them."""
    found, start = {}, 0
    for i in range(file.num_row_groups):
        stop = start + file.metadata.row_group(i).num_rows
        inside = positions[(positions >= start) & (positions < stop)]
        if len(inside):
            group = file.read_row_group(i, columns=columns).to_pandas()
            for p in inside:
                found[int(p)] = group.iloc[int(p) - start]
        start = stop
    return pd.DataFrame([found[int(p)] for p in positions], columns=columns)


def fmt(value: object) -> str:
    """A cell as text: floats to 4 significant digits, numpy scalars as Python values."""
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    if isinstance(value, (np.integer, np.bool_)):
        return str(value.item())
    return str(value)


def is_labels(target: np.ndarray | None) -> bool:
    """True when the targets are class labels: integers with at most MAX_CLASSES values."""
    return (
        target is not None and target.dtype.kind in "iu" and len(np.unique(target)) <= MAX_CLASSES
    )


def top_positions(values: np.ndarray, ok: np.ndarray, spread: Spread, k: int) -> np.ndarray:
    """Row positions of the k largest robust z among ``ok`` rows; by |z| for a signed score."""
    candidates = np.flatnonzero(ok)
    z = spread.z(values[candidates])
    key = np.abs(z) if (values[candidates] < 0).any() else z
    order = np.argsort(-key, kind="stable")[:k]
    return candidates[order]


def per_class(
    values: np.ndarray, ok: np.ndarray, target: np.ndarray, top: np.ndarray, score: str
) -> pd.DataFrame:
    """count, median score (finite rows) and share of the top-k, per class."""
    labels = np.unique(target)
    rows = []
    for label in labels:  # at most MAX_CLASSES: one boolean mask at a time, no frame of all rows
        member = target == label
        scored = values[member & ok]
        median = float(np.median(scored)) if len(scored) else float("nan")
        rows.append(
            (int(member.sum()), median, float((target[top] == label).sum()) / max(len(top), 1))
        )
    return pd.DataFrame(rows, index=labels, columns=["count", f"median {score}", "share of top-k"])


@dataclass
class Outliers:
    """A scores file ranked by one column: every row's score, and the top-k rows in full."""

    file: pq.ParquetFile
    score: str
    values: np.ndarray  # (N,) float64, the ranked column
    ok: np.ndarray  # (N,) bool: finite score and `finite` flag
    target: np.ndarray | None
    spread: Spread
    top: np.ndarray  # (k,) row positions, most extreme first
    rows: pd.DataFrame  # the top rows' SHOWN columns (and the score), in that order

    @property
    def names(self) -> list[str]:
        return self.file.schema_arrow.names


def rank(path: str | Path, score: str | None = None, k: int = 20) -> Outliers:
    """Rank the rows of a scores file by ``score`` (default: influence, else grad_norm)."""
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types: not Parquet, or cut short
        raise DataError(f"not a readable Parquet file: {e}", str(path)) from e
    names = file.schema_arrow.names
    score = score or ("influence" if "influence" in names else "grad_norm")
    if score not in names:
        raise DataError(f"no column {score!r} to rank by (columns: {', '.join(names)})", "--by")
    kind = file.schema_arrow.field(score).type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise DataError(f"column {score!r} holds {kind}, not numbers to rank by", "--by")
    values = column(file, score).astype(np.float64)
    ok = np.isfinite(values) & (column(file, "finite") if "finite" in names else True)
    target = column(file, "target") if "target" in names else None
    spread = Spread.of(values[ok])
    top = top_positions(values, ok, spread, k)
    shown = [c for c in SHOWN if c in names]
    if score not in shown:
        shown.append(score)
    return Outliers(file, score, values, ok, target, spread, top, rows_at(file, top, shown))


def sparkline(found: Outliers) -> Text:
    """The score's histogram on one line, heights by log count; bins holding a top-k row red."""
    finite = found.values[found.ok]
    if not len(finite):
        return Text(f"{found.score}: no finite values")
    counts, edges = np.histogram(finite, bins=SPARK_BINS)
    marked = set(np.clip(np.searchsorted(edges, found.values[found.top], "right") - 1, 0,
                         SPARK_BINS - 1).tolist())  # fmt: skip
    line = Text(f"{found.score} {fmt(edges[0])} ")
    for i, count in enumerate(counts):
        # log heights: the tail's few examples stay visible beside the bulk
        level = min(len(BARS) - 1, int(len(BARS) * np.log1p(count) / np.log1p(counts.max())))
        line.append(BARS[level] if count else " ", style="red" if i in marked else "cyan")
    return line.append(f" {fmt(edges[-1])}  red: top {len(found.top)}")


def _outlier_table(found: Outliers) -> Table:
    table = Table(
        title=f"top {len(found.top)} outliers by {found.score}",
        caption="robust_z = (x - median) / (1.4826 MAD)",
        show_edge=False,  # the prediction columns need the room in an 80-column terminal
    )
    shown = list(found.rows.columns)
    for name in [*shown, "robust_z"]:
        table.add_column(name, justify="right")
    z = found.spread.z(found.values[found.top])
    for (_, row), zi in zip(found.rows.iterrows(), z, strict=True):
        table.add_row(*(fmt(row[c]) for c in shown), fmt(zi))
    return table


def _class_table(found: Outliers) -> Table:
    classes = per_class(found.values, found.ok, found.target, found.top, found.score)
    table = Table(title=f"per class ({found.score})")
    for name in ["target", *classes.columns]:
        table.add_column(name, justify="right")
    for label, row in classes.iterrows():
        table.add_row(str(label), str(int(row["count"])), fmt(row.iloc[1]), f"{row.iloc[2]:.0%}")
    return table


def summarize(path: str | Path, score: str | None = None, k: int = 20) -> Group:
    """The outlier table, the per-class table and the summary paragraph of a scores file."""
    found = rank(path, score, k)
    parts: list[object] = [sparkline(found), _outlier_table(found)]
    if is_labels(found.target):
        parts.append(_class_table(found))
    unit = "(example, reference) pairs" if "ref_id" in found.names else "examples"
    values, ok = found.values, found.ok
    largest = fmt(values[ok].max()) if ok.any() else "-"
    parts.append(
        Text(
            f"{len(values)} {unit}; {found.score}: median {fmt(found.spread.median)}, "
            f"MAD {fmt(found.spread.mad)}, max {largest}; {int((~ok).sum())} non-finite."
        )
    )
    return Group(*parts)
