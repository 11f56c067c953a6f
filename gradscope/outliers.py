"""The outliers of a scores file: its rows ranked by robust z (and within each target class),
top-k at one end or both.

Only the ranked column, `finite` and `target` are held for every row (about 17 bytes a row); the
other columns are read for the top-k rows alone, row group by row group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ConfigError, DataError
from .io.parquet import nested, parse_metadata
from .io.scorefile import Columns, column, rows_at
from .tables import fmt

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MEAN_AD_TO_SIGMA = 1.2533  # and its mean absolute deviation times this (sqrt(pi / 2))
MAX_CLASSES = 100  # above this many distinct targets, the targets are not class labels
SHOWN = (
    "example_id", "ref_id", "id", "loss", "grad_norm", "self_influence", "influence", "cosine",
    "target", "pred", "prob", "margin",
)  # fmt: skip
DIRECTIONS = ("high", "low")


@dataclass
class Spread:
    """Median and MAD of the finite values of a score, and the robust z they define."""

    median: float
    mad: float
    mean_ad: float = 0.0  # the mean absolute deviation from the median

    @classmethod
    def of(cls, values: np.ndarray) -> Spread:
        if not len(values):
            return cls(float("nan"), 0.0)
        median = float(np.median(values))
        deviations = np.abs(values - median)
        return cls(median, float(np.median(deviations)), float(np.mean(deviations)))

    def z(self, values: np.ndarray) -> np.ndarray:
        """(x - median) / (1.4826 MAD); with MAD 0 (over half the values equal), the modified
        z-score's (x - median) / (1.2533 mean absolute deviation), still in units of spread,
        not of the score; with every value equal, x - median (0 at each of them)."""
        scale = MAD_TO_SIGMA * self.mad or MEAN_AD_TO_SIGMA * self.mean_ad
        return (values - self.median) / (scale if scale > 0 else 1.0)


def is_labels(target: np.ndarray | None) -> bool:
    """True when the targets are class labels: integers with at most MAX_CLASSES values."""
    return (
        target is not None and target.dtype.kind in "iu" and len(np.unique(target)) <= MAX_CLASSES
    )


def parse_by(by: str | None) -> tuple[str | None, str | None]:
    """``COLUMN``, ``COLUMN:low`` or ``COLUMN:high`` -> (column, direction); None: the default."""
    if by is None:
        return None, None
    column, colon, direction = by.rpartition(":")
    if not colon:
        return by, None
    if direction not in DIRECTIONS or not column:
        raise ConfigError(f"--by takes COLUMN, COLUMN:low or COLUMN:high, got {by!r}", "--by")
    return column, direction


# the columns a run writes that hold no score, by what they hold
UNRANKED = {"finite": "booleans", "id": "the data's ids"}


def check_by(by: str | None, names: list[str]) -> None:
    """A ``--by`` that names none of the columns a run may write (``Scorer.names``) fails before
    the run: a typo must not cost it."""
    column, _ = parse_by(by)
    if column in UNRANKED:
        raise ConfigError(
            f"column {column!r} holds {UNRANKED[column]}, not scores to rank by", "--by"
        )
    per_module = column is not None and column.startswith("grad_norm/")
    if column is None or column in names or (per_module and "grad_norm/<module>" in names):
        return
    raise ConfigError(
        f"no column {column!r} to rank by; this run writes {', '.join(names)}", "--by"
    )


def default_score(names: list[str]) -> str:
    """What a file ranks by unless told: influence, else self_influence (several checkpoints,
    or a preconditioner), else a query's exact score (``--exact``), else its score, else the
    loss, else grad_norm. Of a norms
    file's columns, the loss finds the most planted faults (benchmarks/detection.py: flipped
    labels, noise inputs, contradicting duplicates), and a file without one (another tool's)
    still ranks."""
    kinds = ("influence", "self_influence", "exact", "score", "loss")
    return next((n for n in kinds if n in names), "grad_norm")


def top_positions(values: np.ndarray, ok: np.ndarray, direction: str, k: int) -> np.ndarray:
    """Row positions of the k largest (``high``) or most negative (``low``) ``ok`` values."""
    candidates = np.flatnonzero(ok)
    key = -values[candidates] if direction == "high" else values[candidates]
    return candidates[np.argsort(key, kind="stable")[:k]]


def class_z(values: np.ndarray, ok: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(N,) robust z of each row's score within its target class (NaN where not ``ok``)."""
    z = np.full(len(values), np.nan)
    for label in np.unique(target):  # at most MAX_CLASSES
        member = target == label
        z[member & ok] = Spread.of(values[member & ok]).z(values[member & ok])
    return z


def per_class(found: Outliers) -> Columns:
    """count, median score (finite rows) and share of each end's top-k, per class."""
    values, ok, target = found.values, found.ok, found.target
    assert target is not None
    labels = np.unique(target)
    table: Columns = {"target": [found.class_name(label) for label in labels], "count": [],
                      f"median {found.score}": []}  # fmt: skip
    shares = {f"share of {e.direction} {len(e.top)}": e.top for e in found.ends}
    if len(found.ends) == 1:
        shares = {f"share of top {len(found.top)}": found.top}
    for name in shares:
        table[name] = []
    for label in labels:  # at most MAX_CLASSES: one mask at a time, no frame of all rows
        member = target == label
        scored = values[member & ok]
        table["count"].append(int(member.sum()))
        table[f"median {found.score}"].append(float(np.median(scored)) if len(scored) else np.nan)
        for name, top in shares.items():
            table[name].append(float((target[top] == label).sum()) / max(len(top), 1))
    return {name: np.asarray(v) for name, v in table.items()}


@dataclass
class End:
    """One end of the ranking: its row positions, most extreme first, and those rows in full."""

    direction: str  # high | low
    label: str  # how the tables name it
    top: np.ndarray  # (k,) row positions
    rows: Columns  # SHOWN columns, the score, robust_z and class_z


@dataclass
class Outliers:
    """A scores file ranked by one column: every row's score, and the top-k rows of each end."""

    file: pq.ParquetFile
    score: str
    values: np.ndarray  # (N,) float64, the ranked column
    ok: np.ndarray  # (N,) bool: finite score and `finite` flag
    target: np.ndarray | None
    spread: Spread
    ends: list[End]
    classes: list[str] | None = None  # names of the class ids

    @property
    def names(self) -> list[str]:
        return self.file.schema_arrow.names

    @property
    def top(self) -> np.ndarray:
        """The top-k rows of every end."""
        return np.concatenate([e.top for e in self.ends])

    def class_name(self, label: object) -> str:
        """A class id as its name (``data.classes``), else as itself."""
        named = self.classes is not None and isinstance(label, (int, np.integer))
        return self.classes[label] if named and 0 <= label < len(self.classes) else fmt(label)


def _ends(score: str, values: np.ndarray, ok: np.ndarray, direction: str | None) -> list[tuple]:
    """(direction, label) of each end to show: the one asked for; unasked, the high end of a
    score with no negative value, both ends of one with any (influence: helpful, then
    harmful)."""
    helpful = score in ("influence", "cosine")
    labels = {
        "high": "highest first" + (" (helpful)" if helpful else ""),
        "low": "lowest first" + (" (harmful)" if helpful else ""),
    }
    if direction is None:
        signed = bool((values[ok] < 0).any())
        return [(d, labels[d]) for d in (("high", "low") if signed else ("high",))]
    return [(direction, labels[direction])]


def rank(
    path: str | Path,
    by: str | None = None,
    k: int = 20,
    classes: list[str] | None = None,
) -> Outliers:
    """Rank the rows of a scores file by ``by`` (``COLUMN[:low|high]``; default:
    ``default_score``)."""
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types: not Parquet, or cut short
        raise DataError(f"not a readable Parquet file: {e}", str(path)) from e
    names = file.schema_arrow.names
    given, direction = parse_by(by)
    score = given or default_score(names)
    if score not in names:
        what = f"no column {score!r} to rank by" if given else (
            "none of the default columns to rank by (influence, self_influence, score, loss, "
            "grad_norm)"
        )  # fmt: skip
        raise DataError(f"{what} (columns: {', '.join(names)}); name one with --by", str(path))
    kind = file.schema_arrow.field(score).type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise DataError(f"column {score!r} holds {kind}, not numbers to rank by", "--by")
    values = column(file, score).astype(np.float64)
    ok = np.isfinite(values) & _finite(file, path)
    target = column(file, "target") if "target" in names else None
    spread = Spread.of(values[ok])
    z_class = class_z(values, ok, target) if is_labels(target) and score != "class_z" else None
    shown = [c for c in SHOWN if c in names]
    if score not in shown:
        shown.append(score)
    ends = []
    for d, label in _ends(score, values, ok, direction):
        top = top_positions(values, ok, d, k)
        rows = rows_at(file, top, shown)
        rows["robust_z"] = spread.z(values[top])
        if z_class is not None:
            rows["class_z"] = z_class[top]
        ends.append(End(d, label, top, rows))
    named = classes or _classes(file)
    _check_classes(named, file, path)
    return Outliers(file, score, values, ok, target, spread, ends, named)


def _check_classes(classes: list[str] | None, file: pq.ParquetFile, path: str | Path) -> None:
    """``data.classes`` names every class id the file's targets and predictions hold: a list
    too short showed some rows by name and the rest by number, without a word."""
    kinds = file.schema_arrow
    ids = {
        n: column(file, n)
        for n in ("target", "pred")
        if classes and n in kinds.names and pa.types.is_integer(kinds.field(n).type)
    }
    check_named(classes, ids, str(path))


def check_named(classes: list[str] | None, ids: dict[str, np.ndarray], where: str) -> None:
    """Every class id of ``ids`` ({column: ids}: a file's, or a batch's as it is scored) is
    one that ``data.classes`` names, where it names any."""
    for name, values in ids.items() if classes else ():
        if len(values) and values.max() >= len(classes):
            raise DataError(
                f"data.classes names {len(classes)} classes; column {name} holds class "
                f"{int(values.max())}: give a name to every class",
                where,
            )


def _finite(file: pq.ParquetFile, path: str | Path) -> np.ndarray | bool:
    """The ``finite`` flags as booleans (another tool may have written them as 0 and 1; a
    missing flag is false); True without the column."""
    if "finite" not in file.schema_arrow.names:
        return True
    kind = file.schema_arrow.field("finite").type
    if not (pa.types.is_boolean(kind) or pa.types.is_integer(kind)):
        raise DataError(f"column 'finite' holds {kind}, not true or false", str(path))
    flags = column(file, "finite")
    if flags.dtype.kind == "f":  # integer flags with one missing are read as floats, it NaN
        flags = np.nan_to_num(flags, nan=0.0)
    return flags.astype(bool)


def _classes(file: pq.ParquetFile) -> list[str] | None:
    """``data.classes`` of the run that wrote the file, from its metadata (full metadata only;
    a value that is not a list of names, as another tool may leave it, is none)."""
    meta = parse_metadata(file.schema_arrow.metadata)
    classes = nested(meta, "config", "data", "classes")
    return (
        classes if isinstance(classes, list) and all(isinstance(c, str) for c in classes) else None
    )


def bin_edges(values: np.ndarray, bins: int) -> np.ndarray | int:
    """``bins`` equal bins over the finite ``values``' range: the count itself, or the edges
    where numpy's own would overflow (a range past the largest float, ``-1e308`` to ``1e308``:
    "Too many bins for data range")."""
    lo, hi = (float(values.min()), float(values.max())) if len(values) else (0.0, 0.0)
    if np.isfinite(hi - lo):
        return bins
    t = np.linspace(0.0, 1.0, bins + 1)
    return lo * (1 - t) + hi * t
