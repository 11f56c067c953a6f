"""The report of a watch file (``gradscope.training.watch``): the data map of Swayamdipta et
al. (2020), each example's mean confidence in its target across epochs against its
variability, coloured by how often it was right, and the examples whose gradient norm stays
high through training."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ..errors import DataError
from ..tables import fmt
from .charts import STYLE, _svg

NEEDED = ("epoch", "example_id", "grad_norm")  # and prob for the map (a classifier's, an LM's)


@dataclass(frozen=True)
class DataMap:
    """Per example (``ids``, sorted): its per-epoch means reduced over the epochs."""

    ids: np.ndarray
    epochs: int
    confidence: np.ndarray  # mean over epochs of the probability of the target
    variability: np.ndarray  # standard deviation over epochs of it
    correctness: np.ndarray  # mean over epochs of `correct` (NaN without the column)
    grad_norm: np.ndarray  # mean over epochs of grad_norm
    lowest_rank: np.ndarray  # lowest over the epochs that saw it of the grad_norm's percentile
    # in its epoch; NaN where fewer than half the epochs saw a finite grad_norm of it


def _per_epoch(ids: np.ndarray, epochs: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(examples, epochs) mean of ``values`` over each example's rows of an epoch; NaN where
    an example has none."""
    e_ids, e_at = np.unique(ids, return_inverse=True)
    p_ids, p_at = np.unique(epochs, return_inverse=True)
    sums = np.zeros((len(e_ids), len(p_ids)))
    counts = np.zeros_like(sums)
    ok = np.isfinite(values)
    np.add.at(sums, (e_at[ok], p_at[ok]), values[ok])
    np.add.at(counts, (e_at[ok], p_at[ok]), 1)
    with np.errstate(invalid="ignore"):
        return sums / np.where(counts > 0, counts, np.nan)


def _percentiles(table: np.ndarray) -> np.ndarray:
    """Each column's values as their percentile (0..100) within the column, tied values at
    their ranks' mean (not by their examples' order); NaN stays."""
    out = np.full_like(table, np.nan)
    for j in range(table.shape[1]):
        ok = np.isfinite(table[:, j])
        _, at, counts = np.unique(table[ok, j], return_inverse=True, return_counts=True)
        ranks = (np.cumsum(counts) - (counts + 1) / 2)[at]  # 0-based, ties averaged
        out[ok, j] = 100.0 * ranks / max(ok.sum() - 1, 1)
    return out


def _lowest(percentiles: np.ndarray) -> np.ndarray:
    """(examples,) each row's lowest percentile over the epochs that saw it, NaN where fewer than
    half did: one epoch's high norm is no norm that stays high (a partial last epoch, or
    drop_last's few rows an epoch, leave an example out of one or two)."""
    seen = np.isfinite(percentiles).sum(1)
    lowest = np.nanmin(np.where(seen[:, None] > 0, percentiles, 0.0), 1)
    return np.where(2 * seen >= percentiles.shape[1], lowest, np.nan)


def data_map(path: Path) -> DataMap:
    """The data map of a watch file; without ``prob`` (a regression's, a loss of the user's:
    no probability of a target), its confidence and variability NaN."""
    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    missing = [n for n in NEEDED if n not in names]
    if missing:
        raise DataError(f"the watch file lacks {', '.join(missing)}: no report", str(path))
    wanted = [*NEEDED, *(n for n in ("prob", "correct", "finite") if n in names)]
    table = {n: c.to_numpy() for n, c in zip(wanted, file.read(wanted).columns, strict=True)}
    ids, epochs = table["example_id"], table["epoch"]
    norms = table["grad_norm"].astype(np.float64)
    probs = table["prob"].astype(np.float64) if "prob" in table else np.full_like(norms, np.nan)
    prob = _per_epoch(ids, epochs, probs)
    if "finite" in table:  # a row of no counted target (its grad_norm 0) ranks under no column
        norms = np.where(table["finite"].astype(bool), norms, np.nan)
    norm = _per_epoch(ids, epochs, norms)
    correct = (
        _per_epoch(ids, epochs, table["correct"].astype(np.float64))
        if "correct" in table
        else np.full_like(prob, np.nan)
    )
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an example with no finite value: NaN
        return DataMap(
            np.unique(ids),
            prob.shape[1],
            np.nanmean(prob, 1),
            np.nanstd(prob, 1),
            np.nanmean(correct, 1),
            np.nanmean(norm, 1),
            _lowest(_percentiles(norm)),
        )


def chart(found: DataMap) -> str:
    """Variability (x) against confidence (y), coloured by correctness, as the paper draws."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    with rc_context(STYLE):
        figure = Figure(figsize=(6, 5), layout="constrained")
        ax = figure.subplots()
        colour = np.nan_to_num(found.correctness, nan=0.0)
        dots = ax.scatter(found.variability, found.confidence, c=colour, s=10, cmap="coolwarm_r",
                          vmin=0, vmax=1, rasterized=len(found.ids) > 5000)  # fmt: skip
        figure.colorbar(dots, ax=ax, label="correctness (share of epochs right)")
        ax.set_xlabel("variability (std of the target's probability over epochs)")
        ax.set_ylabel("confidence (mean probability of the target)")
    return _svg(figure)


def stays_high(found: DataMap, k: int) -> list[dict[str, str]]:
    """The k examples whose gradient norm ranks highest in their epoch at every epoch: the
    largest lowest percentile first; the map's columns where the file has them."""
    ok = np.flatnonzero(np.isfinite(found.lowest_rank))
    top = ok[np.argsort(-found.lowest_rank[ok], kind="stable")[:k]]
    mapped = {"confidence": found.confidence, "variability": found.variability,
              "correctness": found.correctness}  # fmt: skip
    shown = {k: v for k, v in mapped.items() if np.isfinite(v).any()}
    return [
        {
            "example_id": str(int(found.ids[i])),
            "lowest grad_norm percentile": fmt(found.lowest_rank[i]),
            "mean grad_norm": fmt(found.grad_norm[i]),
        }
        | {name: fmt(values[i]) for name, values in shown.items()}
        for i in top
    ]


def render(path: Path, meta: dict, version: str, k: int) -> str:
    """The report page of a watch file as HTML text."""
    import jinja2

    found = data_map(path)
    if not len(found.ids):
        raise DataError("the watch file has no rows: nothing to report", str(path))
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gradscope", "report"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    rows = stays_high(found, k)
    return env.get_template("watch.html.j2").render(
        title=path.name,
        loss=meta.get("loss", "?"),
        version=version,
        n=len(found.ids),
        epochs=found.epochs,
        chart=chart(found) if np.isfinite(found.confidence).any() else None,
        header=list(rows[0]) if rows else [],
        rows=rows,
        unranked=int((~np.isfinite(found.lowest_rank)).sum()),
    )
