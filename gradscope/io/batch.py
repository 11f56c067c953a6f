"""Batches of rows, joined, cut and picked from to the configured size (list columns kept as
rows until padded; ``convert.py`` makes columns tensors)."""

from __future__ import annotations

import hashlib
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


def batch_sha256(batch: Batch) -> str:
    """The sha256 of a batch's rows: their positions, inputs, targets and ids, bit for bit with
    their dtypes and shapes (what a resume compares where no file's hash holds the data); a
    column not yet padded, row by row as stored."""
    h = hashlib.sha256()
    for value in (batch.index, *batch.inputs, batch.targets):
        if isinstance(value, list):  # rows of a column to pad
            h.update(f"{len(value)} rows;".encode())
            for row in map(np.ascontiguousarray, value):
                h.update(f"{row.dtype} {row.shape};".encode() + row.tobytes())
            continue
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if batch.ids is not None:
        h.update("\0".join(map(str, batch.ids.tolist())).encode())
    return h.hexdigest()


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
