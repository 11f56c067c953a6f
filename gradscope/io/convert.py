"""Columns made tensors: numbers (or equal-length lists of them) as one tensor, ragged columns
named in one error, and the columns of ``data.pad`` as row arrays, padded per batch."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError
from .batch import Columns


def as_tensor(values: Any, name: str, where: str) -> Tensor:
    """A column of numbers (or of equal-length lists of them) as one tensor."""
    if isinstance(values, Tensor):
        return values
    array = np.asarray(values)
    if array.dtype == object:
        _no_text(array, name, where)
        try:  # a column of equal-length lists (Parquet list<...>)
            array = np.stack([np.asarray(v) for v in array])
        except ValueError as e:
            raise DataError(
                f"column {name!r} holds lists of different lengths; set data.pad.{name} to pad "
                "them per batch",
                where,
            ) from e
    if array.dtype.kind in "US":
        _no_text(array.astype(object), name, where)
    if array.dtype.kind not in "biuf":
        raise DataError(f"column {name!r} is {array.dtype}, not numbers", where)
    if not array.flags.writeable:  # Arrow's zero-copy buffers; torch wants memory it may write
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _no_text(array: np.ndarray, name: str, where: str) -> None:
    """A column of objects holds no text and no null (a CSV's number column with a word in it,
    a Parquet list column with a missing row): either named, not taken for ragged lists."""
    values = list(array.flat)
    if any(v is None for v in values):
        raise DataError(f"column {name!r} holds a null (a missing value), not numbers", where)
    texts = [v for v in values if isinstance(v, str | bytes)]
    if texts:  # the first that reads as no number: the one that made the column text
        bad = next((v for v in texts if not _number(v)), texts[0])
        raise DataError(f"column {name!r} holds text ({bad!r}), not numbers", where)


def _number(text: str | bytes) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_ragged(values: Any) -> bool:
    """Whether a column holds lists of different lengths (an object array or a Python list)."""
    if isinstance(values, Tensor) or (isinstance(values, np.ndarray) and values.dtype != object):
        return False
    if any(v is None or isinstance(v, str | bytes) for v in values):
        return False  # not lists: ``as_tensor`` names what it holds
    try:
        return len({len(v) for v in values}) > 1
    except TypeError:  # scalars: not lists
        return False


def check_ragged(columns: Columns, names: list[str], where: str) -> None:
    """Every ragged column without a pad value named in one error, not one run at a time."""
    ragged = [n for n in dict.fromkeys(names) if _is_ragged(columns[n])]
    if not ragged:
        return
    listed = " and ".join(", ".join(repr(n) for n in ragged).rsplit(", ", 1))
    keys = " and ".join(", ".join(f"data.pad.{n}" for n in ragged).rsplit(", ", 1))
    what = "column" if len(ragged) == 1 else "columns"
    holds = "holds" if len(ragged) == 1 else "hold"
    raise DataError(
        f"{what} {listed} {holds} lists of different lengths; set {keys} to pad them per batch",
        where,
    )


def row_arrays(values: Any, name: str, where: str) -> list[np.ndarray]:
    """A column to pad, as one array per row (a list column read from Arrow, or a tensor)."""
    rows = [np.asarray(v) for v in values]
    for row in rows:
        if row.dtype.kind not in "biuf" or row.ndim == 0:
            raise DataError(
                f"column {name!r} is padded per batch (data.pad; under causal_lm, the targets "
                "by default) but does not hold a row of numbers per example",
                where,
            )
    return rows


def pad_rows(rows: list[np.ndarray], value: float, name: str) -> Tensor:
    """(B, T, ...) with each row's (T_i, ...) values first and ``value`` after, T the longest."""
    dtype = functools.reduce(np.promote_types, {r.dtype for r in rows})
    if dtype.kind in "biu":
        dtype = np.dtype(
            np.int64
        )  # token ids and masks (datasets stores int32, int8): torch's index type
    if dtype.kind in "biu" and value != int(value):
        raise DataError(
            f"column {name!r} holds integers; its pad value {value} is not one", "data.pad"
        )
    tails = {r.shape[1:] for r in rows}
    if len(tails) > 1:
        raise DataError(
            f"column {name!r} holds rows of shapes {sorted(tails)} after the first dim", "data.pad"
        )
    out = np.full((len(rows), max(len(r) for r in rows), *tails.pop()), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)
