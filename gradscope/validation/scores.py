"""Score files as validation reads them: each score column as a (references, examples) matrix,
checked against the reference set and the training rows it is validated on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError, one_line
from ..io.parquet import nested, read_metadata

# the columns that rank examples for detection, and which end is suspicious: a high loss or
# gradient, a low margin or probability, a harmful (negative) influence
RANKED = {
    "grad_norm": "high",
    "loss": "high",
    "self_influence": "high",
    "margin": "low",
    "prob": "low",
    "influence": "low",
    "cosine": "low",
}


@dataclass
class ScoreFile:
    """One score file's columns, each (R, N): R references for an ``influence --per-ref`` file,
    else one row (scored against the mean loss over REF, or no reference at all)."""

    path: Path
    per_ref: bool
    refs: int  # R: the references of a per-ref file, else 1
    columns: dict[str, np.ndarray]  # name -> (R, N)
    seconds: float | None  # the scoring run's own time, where its metadata records one

    def suspicion(self, name: str) -> np.ndarray:
        """(N,) column ``name`` with the suspicious end high: a per-ref column's mean over the
        references (for influence, the influence on the mean loss over REF)."""
        values = self.columns[name].mean(0)  # (N,)
        return -values if RANKED[name] == "low" else values


def read_scores(
    path: Path,
    wanted: list[str],
    rows: int,
    refs: int,
    ref_sha256: str | None,
    data_sha256: str | None,
) -> ScoreFile:
    """Columns ``wanted`` of a score file (those it has) for ``rows`` training rows and ``refs``
    references; refused, as a DataError naming the file, when its metadata says it was computed
    on other data or against another REF, when its rows are not exactly the training rows (each
    against every reference, for a per-ref file), or when a score is not finite."""
    meta = read_metadata(path)
    _check_source(path, meta, ref_sha256, data_sha256)
    names = pq.read_schema(path).names
    if "example_id" not in names:
        raise DataError("not a gradscope scores file: no example_id column", str(path))
    per_ref = "ref_id" in names
    keys = ["example_id", *(["ref_id"] if per_ref else [])]
    try:
        kept = [n for n in dict.fromkeys(wanted) if n in names and n not in keys]
        table = pq.read_table(path, columns=keys + kept)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"not a readable Parquet file: {one_line(e)}", str(path)) from e
    example = table.column("example_id").to_numpy()
    ref = table.column("ref_id").to_numpy() if per_ref else np.zeros_like(example)
    height = refs if per_ref else 1
    _check_rows(path, example, ref, rows, height)
    columns = {}
    for name in table.column_names[len(keys) :]:
        columns[name] = _column(path, name, table.column(name), ref, example, (height, rows))
    seconds = nested(meta, "seconds")
    seconds = float(seconds) if isinstance(seconds, (int, float)) else None
    return ScoreFile(Path(path), per_ref, height, columns, seconds)


def _check_source(path: Path, meta: dict, ref_sha256: str | None, data_sha256: str | None) -> None:
    """Refuse scores whose metadata records another REF or other data than this run's."""
    for key, mine, what in (
        (("influence", "ref_sha256"), ref_sha256, "against another REF than --ref"),
        (("data_sha256",), data_sha256, "on other data than data.path"),
    ):
        theirs = nested(meta, *key)
        if isinstance(theirs, str) and mine is not None and theirs != mine:
            raise DataError(f"the scores were computed {what} ({'.'.join(key)} differs)", str(path))


def _column(
    path: Path, name: str, column: pa.ChunkedArray, ref: np.ndarray, example: np.ndarray, shape
) -> np.ndarray:
    """(R, N) one score column, each value finite; refused where it ranks nothing (the same
    value on every row: a subset's predicted change then differs only by rounding)."""
    matrix = np.empty(shape)
    try:
        matrix[ref, example] = column.to_numpy(zero_copy_only=False)
    except (TypeError, ValueError) as e:
        raise DataError(
            f"column {name!r} is not one number per row ({column.type})", str(path)
        ) from e
    bad = int((~np.isfinite(matrix)).sum())
    if bad:
        raise DataError(f"{bad} values of column {name!r} are NaN or infinite", str(path))
    flat = np.flatnonzero(matrix.min(1) == matrix.max(1))
    if len(flat):
        against = f" against reference {flat[0]}" if shape[0] > 1 else ""
        raise DataError(
            f"column {name!r} is the same for every row{against}: it ranks nothing", str(path)
        )
    return matrix


def _check_rows(path: Path, example: np.ndarray, ref: np.ndarray, rows: int, refs: int) -> None:
    """Every (reference, training row) pair exactly once, nothing else; ids are integers."""
    for name, ids in (("example_id", example), ("ref_id", ref)):
        if not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"the scores' {name} column holds {ids.dtype}, not integers", str(path))
    ids = np.unique(example)
    if len(ids) != rows or not len(ids) or ids[0] != 0 or ids[-1] != rows - 1:
        span = f", {ids.min()}..{ids.max()}" if len(ids) else ""
        raise DataError(
            f"the scores' example ids ({len(ids)} of them{span}) are not the "
            f"{rows} training rows 0..{rows - 1} of data.path",
            str(path),
        )
    if ref.min() < 0 or ref.max() >= refs:
        raise DataError(
            f"the scores' ref_id runs {ref.min()}..{ref.max()}; --ref has {refs} examples",
            str(path),
        )
    if len(np.unique(ref * rows + example)) != len(example) or len(example) != rows * refs:
        raise DataError(
            f"the scores do not hold each of the {rows} training rows once"
            + (f" for each of the {refs} references" if refs > 1 else ""),
            str(path),
        )
