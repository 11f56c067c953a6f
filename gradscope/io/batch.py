"""Batches of rows: columns made tensors (list columns kept as rows until padded), and batches
joined, cut and picked from to the configured size."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError, one_line

Columns = dict[str, Any]  # name -> tensor, array or list, for a run of consecutive rows


@dataclass
class Batch:
    """One batch: ``index`` holds each row's 0-based position in the dataset.

    Columns named in ``data.pad`` stay lists of row arrays until the batch is cut, then are padded.
    """

    index: Tensor  # (B,) int64
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)


def as_tensor(values: Any, name: str, where: str) -> Tensor:
    """A column of numbers (or of equal-length lists of them) as one tensor."""
    if isinstance(values, Tensor):
        return values
    array = np.asarray(values)
    if array.dtype == object:
        try:  # a column of equal-length lists (Parquet list<...>)
            array = np.stack([np.asarray(v) for v in array])
        except ValueError as e:
            raise DataError(
                f"column {name!r} holds lists of different lengths; set data.pad.{name} to pad "
                "them per batch",
                where,
            ) from e
    if array.dtype.kind not in "biuf":
        raise DataError(f"column {name!r} is {array.dtype}, not numbers", where)
    if not array.flags.writeable:  # Arrow's zero-copy buffers; torch wants memory it may write
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _is_ragged(values: Any) -> bool:
    """Whether a column holds lists of different lengths (an object array or a Python list)."""
    if isinstance(values, Tensor) or (isinstance(values, np.ndarray) and values.dtype != object):
        return False
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
                f"column {name!r} is in data.pad but does not hold lists of numbers", where
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


def _join(parts: list[Any]) -> Any:
    """Tensors concatenated along rows; rows of a column to pad, one list."""
    if isinstance(parts[0], list):
        return list(itertools.chain.from_iterable(parts))
    return torch.cat(parts)


def _cat(parts: list[Batch]) -> Batch:
    if len(parts) == 1:
        return parts[0]
    try:
        return Batch(
            index=torch.cat([p.index for p in parts]),
            inputs=tuple(_join(list(ts)) for ts in zip(*(p.inputs for p in parts), strict=True)),
            targets=_join([p.targets for p in parts]),
            ids=None if parts[0].ids is None else np.concatenate([p.ids for p in parts]),
        )
    except (RuntimeError, ValueError) as e:  # shards whose rows differ in shape or kind
        raise DataError(
            f"row {int(parts[-1].index[0])} and the rows before it do not fit one batch: the "
            f"shards' columns differ in shape ({one_line(e)})",
            "data.path",
        ) from e


def _slice(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(
        index=batch.index[lo:hi],
        inputs=tuple(t[lo:hi] for t in batch.inputs),
        targets=batch.targets[lo:hi],
        ids=None if batch.ids is None else batch.ids[lo:hi],
    )


def take(batch: Batch, rows: Tensor) -> Batch:
    """The batch's rows at positions ``rows`` (0-based within the batch), in that order."""
    picked = rows.tolist()

    def pick(values: Any) -> Any:
        return [values[i] for i in picked] if isinstance(values, list) else values[rows]

    return Batch(
        index=batch.index[rows],
        inputs=tuple(pick(t) for t in batch.inputs),
        targets=pick(batch.targets),
        ids=None if batch.ids is None else batch.ids[rows.numpy()],
    )


def rebatch(chunks: Iterable[Batch], batch_size: int, limit: int | None) -> Iterator[Batch]:
    """Cut runs of rows of any length into batches of ``batch_size``; stop reading at ``limit``."""
    pending: list[Batch] = []
    rows = 0  # in pending
    seen = 0  # rows taken from the source so far
    for chunk in chunks:
        if limit is not None and seen + len(chunk) > limit:
            chunk = _slice(chunk, 0, limit - seen)
        seen += len(chunk)
        pending.append(chunk)
        rows += len(chunk)
        while rows >= batch_size:
            whole = _cat(pending)
            yield _slice(whole, 0, batch_size)
            pending = [_slice(whole, batch_size, rows)] if rows > batch_size else []
            rows -= batch_size
        if limit is not None and seen >= limit:
            break
    if rows:
        yield _cat(pending)
