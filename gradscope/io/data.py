"""Datasets from files: named columns, read in batches, each row keeping its position."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config import DataConfig
from ..errors import DataError
from .model import import_object

FORMATS = (".pt", ".pth", ".npz", ".parquet", ".csv")


@dataclass
class Batch:
    """One batch: ``index`` holds each row's 0-based position in the dataset."""

    index: Tensor  # (B,) int64
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ids: np.ndarray | None = None


def _as_tensor(values: Any, name: str, where: str) -> Tensor:
    if isinstance(values, Tensor):
        return values
    array = np.asarray(values)
    if array.dtype == object:
        try:  # a column of equal-length lists (Parquet list<...>)
            array = np.stack([np.asarray(v) for v in array])
        except ValueError as e:
            raise DataError(f"column {name!r} holds values of different shapes", where) from e
    if array.dtype.kind not in "biuf":
        raise DataError(f"column {name!r} is {array.dtype}, not numbers", where)
    return torch.from_numpy(np.ascontiguousarray(array))


def _read_columns(path: str) -> dict[str, Any]:
    """Read a whole file into named columns (tensors, arrays or lists)."""
    if ".py:" in path:
        make = import_object(path, "data.path")
        columns = make()
        if not isinstance(columns, dict):
            raise DataError(
                f"{path} returned a {type(columns).__name__}, not a dict of columns", "data.path"
            )
        return columns
    file = Path(path)
    if not file.is_file():
        raise DataError("data file not found", str(file))
    suffix = file.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            columns = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(columns, dict):
                raise DataError(
                    f"expected a dict of tensors, found a {type(columns).__name__}", str(file)
                )
            return columns
        if suffix == ".npz":
            with np.load(file, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(file)
            return {
                name: table.column(name).to_numpy(zero_copy_only=False)
                for name in table.column_names
            }
        if suffix == ".csv":
            import pandas as pd

            frame = pd.read_csv(file)
            return {name: frame[name].to_numpy() for name in frame.columns}
    except DataError:
        raise
    except Exception as e:  # every reader has its own error types; all mean "unreadable"
        raise DataError(f"cannot read data file: {e}", str(file)) from e
    raise DataError(
        f"unsupported data format {suffix!r}; expected one of {', '.join(FORMATS)} or file.py:fn",
        str(file),
    )


class TableDataset:
    """An in-memory table of named columns, cut into batches in row order."""

    def __init__(
        self,
        columns: dict[str, Any],
        inputs: Sequence[str],
        targets: str,
        ids: str | None,
        where: str,
    ):
        names = [*inputs, targets] + ([ids] if ids else [])
        keys = ["data.inputs"] * len(inputs) + ["data.targets"] + (["data.ids"] if ids else [])
        for name, key in zip(names, keys, strict=True):
            if name not in columns:
                raise DataError(
                    f"no column {name!r} for {key} (columns: {', '.join(map(str, columns))})", where
                )
        self.inputs = tuple(_as_tensor(columns[n], n, where) for n in inputs)
        self.targets = _as_tensor(columns[targets], targets, where)
        self.ids = np.asarray(columns[ids]) if ids else None
        lengths = {len(t) for t in (*self.inputs, self.targets)} | (
            {len(self.ids)} if ids else set()
        )
        if len(lengths) != 1:
            raise DataError(f"columns have different numbers of rows: {sorted(lengths)}", where)
        self.n = lengths.pop()

    def __len__(self) -> int:
        return self.n

    def batches(self, batch_size: int, limit: int | None = None, start: int = 0) -> Iterator[Batch]:
        stop = self.n if limit is None else min(self.n, limit)
        for lo in range(start, stop, batch_size):
            hi = min(lo + batch_size, stop)
            yield Batch(
                index=torch.arange(lo, hi),
                inputs=tuple(t[lo:hi] for t in self.inputs),
                targets=self.targets[lo:hi],
                ids=None if self.ids is None else self.ids[lo:hi],
            )


def open_dataset(cfg: DataConfig, path: str | None = None) -> TableDataset:
    """Open ``path`` (default: ``data.path``) with the columns named in ``cfg``."""
    path = path or cfg.path
    dataset = TableDataset(_read_columns(path), cfg.inputs, cfg.targets, cfg.ids, path)
    if len(dataset) == 0:
        raise DataError("the dataset is empty", path)
    return dataset
