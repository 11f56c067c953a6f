"""Outlier tables from a scores frame: top-k by robust z, a one-paragraph summary, per class."""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.console import Group
from rich.table import Table
from rich.text import Text

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MAX_CLASSES = 100  # above this many distinct targets, the targets are not class labels


def robust_z(values: pd.Series) -> pd.Series:
    """(x - median) / (1.4826 * MAD) over the finite values; NaN where x is not finite."""
    finite = values[np.isfinite(values)]
    median = finite.median()
    mad = (finite - median).abs().median()
    scale = MAD_TO_SIGMA * mad if mad > 0 else finite.std()
    return (values - median) / (scale if scale and scale > 0 else 1.0)


def default_score(frame: pd.DataFrame) -> str:
    return "influence" if "influence" in frame.columns else "grad_norm"


def top_outliers(frame: pd.DataFrame, score: str, k: int) -> pd.DataFrame:
    """The k finite rows of largest robust z; by |z| when the score takes both signs (influence)."""
    rows = frame.loc[frame["finite"]] if "finite" in frame.columns else frame
    z = robust_z(rows[score])
    key = z.abs() if (rows[score] < 0).any() else z
    order = key.sort_values(ascending=False, kind="stable").index[:k]
    return rows.loc[order].assign(robust_z=z.loc[order])


def _is_labels(frame: pd.DataFrame) -> bool:
    return (
        "target" in frame.columns
        and frame["target"].dtype.kind in "iu"
        and frame["target"].nunique() <= MAX_CLASSES
    )


def per_class(frame: pd.DataFrame, score: str, top: pd.DataFrame) -> pd.DataFrame | None:
    """count, median score and share of the top-k per class, when targets are class labels."""
    if not _is_labels(frame):
        return None
    grouped = frame.groupby("target")[score]
    table = pd.DataFrame({"count": grouped.size(), f"median {score}": grouped.median()})
    table["share of top-k"] = top["target"].value_counts().reindex(table.index, fill_value=0) / max(
        len(top), 1
    )
    return table


def _fmt(value: object) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    return str(value)


def render(frame: pd.DataFrame, score: str | None = None, k: int = 20) -> Group:
    """The outlier table, the per-class table and the summary paragraph, ready to print."""
    score = score or default_score(frame)
    if score not in frame.columns:
        from .errors import DataError

        raise DataError(
            f"no column {score!r} to rank by (columns: {', '.join(frame.columns)})", "--by"
        )
    top = top_outliers(frame, score, k)
    shown = [
        c
        for c in ("example_id", "id", "loss", "grad_norm", "influence", "cosine", "target")
        if c in frame
    ]
    if score not in shown:
        shown.append(score)
    table = Table(
        title=f"top {len(top)} outliers by {score}",
        caption="robust_z = (x - median) / (1.4826 MAD)",
    )
    for column in [*shown, "robust_z"]:
        table.add_column(column, justify="right")
    for _, row in top.iterrows():
        table.add_row(*(_fmt(row[c]) for c in [*shown, "robust_z"]))
    parts: list[object] = [table]
    classes = per_class(frame, score, top)
    if classes is not None:
        ct = Table(title=f"per class ({score})")
        for column in ["target", *classes.columns]:
            ct.add_column(column, justify="right")
        for target, row in classes.iterrows():
            ct.add_row(str(target), str(int(row["count"])), _fmt(row.iloc[1]), f"{row.iloc[2]:.0%}")
        parts.append(ct)
    values = frame[score]
    finite = values[np.isfinite(values) & frame.get("finite", True)]
    median = finite.median()
    mad = (finite - median).abs().median()
    bad = len(frame) - len(finite)
    unit = "(example, reference) pairs" if "ref_id" in frame else "examples"
    parts.append(
        Text(
            f"{len(frame)} {unit}; {score}: median {_fmt(median)}, MAD {_fmt(mad)}, "
            f"max {_fmt(finite.max())}; {bad} non-finite."
        )
    )
    return Group(*parts)
