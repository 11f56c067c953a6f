"""Datasets from files, shards and user functions: streamed in batches, each row keeping its position."""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable, Iterator, Sequence
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
Columns = dict[str, Any]  # name -> tensor, array or list, for a run of consecutive rows


@dataclass
class Batch:
    """One batch: ``index`` holds each row's 0-based position in the dataset."""

    index: Tensor  # (B,) int64
    inputs: tuple[Tensor, ...]
    targets: Tensor
    ids: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)


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
    if not array.flags.writeable:  # Arrow's zero-copy buffers; torch wants memory it may write
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _cat(parts: list[Batch]) -> Batch:
    if len(parts) == 1:
        return parts[0]
    return Batch(
        index=torch.cat([p.index for p in parts]),
        inputs=tuple(torch.cat(ts) for ts in zip(*(p.inputs for p in parts), strict=True)),
        targets=torch.cat([p.targets for p in parts]),
        ids=None if parts[0].ids is None else np.concatenate([p.ids for p in parts]),
    )


def _slice(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(
        index=batch.index[lo:hi],
        inputs=tuple(t[lo:hi] for t in batch.inputs),
        targets=batch.targets[lo:hi],
        ids=None if batch.ids is None else batch.ids[lo:hi],
    )


def _rebatch(chunks: Iterable[Batch], batch_size: int, limit: int | None) -> Iterator[Batch]:
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


class _Columns:
    """Turns a source's named columns into Batch rows, checking the configured names once."""

    def __init__(self, inputs: Sequence[str], targets: str, ids: str | None):
        self.names = [*inputs, targets] + ([ids] if ids else [])
        self.keys = ["data.inputs"] * len(inputs) + ["data.targets"] + (["data.ids"] if ids else [])
        self.n_inputs, self.has_ids = len(inputs), ids is not None

    def check(self, available: Iterable[str], where: str) -> None:
        available = list(available)
        for name, key in zip(self.names, self.keys, strict=True):
            if name not in available:
                raise DataError(
                    f"no column {name!r} for {key} (columns: {', '.join(map(str, available))})",
                    where,
                )

    def batch(self, columns: Columns, start: int, where: str) -> Batch:
        """Rows ``start, start + 1, ...`` of the dataset from one source's ``columns``."""
        self.check(columns, where)
        k = self.n_inputs
        tensors = [_as_tensor(columns[n], n, where) for n in self.names[: k + 1]]
        ids = _ids(columns[self.names[-1]], self.names[-1], start, where) if self.has_ids else None
        lengths = {len(t) for t in tensors} | ({len(ids)} if ids is not None else set())
        if len(lengths) != 1:
            raise DataError(f"columns have different numbers of rows: {sorted(lengths)}", where)
        n = lengths.pop()
        return Batch(torch.arange(start, start + n), tuple(tensors[:k]), tensors[k], ids)


def _ids(values: Any, name: str, start: int, where: str) -> np.ndarray:
    """The ids of a run of rows; a missing one (a null, read as NaN or None) is an error here,
    not a column of another type at assembly."""
    ids = np.asarray(values)
    if ids.dtype.kind == "f":
        missing = np.isnan(ids)
    elif ids.dtype == object:
        missing = np.array([v is None for v in ids], dtype=bool)
    else:
        return ids
    if missing.any():
        row = start + int(np.flatnonzero(missing)[0])
        raise DataError(f"column {name!r} for data.ids has no value at row {row}", where)
    return ids


def _collate(items: list[Any], names: list[str], n_inputs: int, where: str) -> Columns:
    """Items of a torch Dataset -> columns: a dict per item, or a tuple (*inputs, target)."""
    first = items[0]
    if isinstance(first, dict):
        missing = [n for n in names if n not in first]
        if missing:
            raise DataError(
                f"dataset items have no key {missing[0]!r} (keys: {', '.join(map(str, first))})",
                where,
            )
        keys: list[Any] = names
    elif isinstance(first, (tuple, list)):
        if len(first) != n_inputs + 1:
            raise DataError(
                f"dataset items are tuples of {len(first)}; expected {n_inputs + 1} "
                "(the data.inputs in order, then the target) or dicts keyed by column name",
                where,
            )
        keys = list(range(n_inputs + 1))
        names = names[: n_inputs + 1]  # ids come only from dict items
    else:
        raise DataError(
            f"dataset items are {type(first).__name__}; expected dicts or tuples of tensors", where
        )
    columns: Columns = {}
    for name, key in zip(names, keys, strict=True):
        values = [item[key] for item in items]
        if all(isinstance(v, (Tensor, int, float, bool)) for v in values):
            columns[name] = torch.stack([torch.as_tensor(v) for v in values])
        else:
            columns[name] = values
    return columns


@dataclass
class _Source:
    """One shard: ``length`` rows (None until read) and a way to read it in runs of rows."""

    where: str
    length: int | None
    read: Callable[[int], Iterator[Columns]]  # rows per run -> runs of rows
    names: list[str] | None = None  # the columns, when known without reading the rows
    whole: bool = False  # read in one piece (.pt, .npz): its size is known only once read


def _file_source(path: str) -> _Source:
    file = Path(path)
    if not file.is_file():
        raise DataError("data file not found", str(file))
    suffix = file.suffix.lower()
    if suffix in (".pt", ".pth"):

        def read_pt(_: int) -> Iterator[Columns]:
            columns = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(columns, dict):
                raise DataError(
                    f"expected a dict of tensors, found a {type(columns).__name__}", str(file)
                )
            yield columns

        return _Source(str(file), None, read_pt, whole=True)
    if suffix == ".npz":

        def read_npz(_: int) -> Iterator[Columns]:
            with np.load(file, allow_pickle=False) as npz:
                yield {k: npz[k] for k in npz.files}

        return _Source(str(file), None, read_npz, whole=True)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(file).schema_arrow.names
            n_rows = pq.ParquetFile(file).metadata.num_rows
        except Exception as e:  # pyarrow's own error types; all mean "unreadable"
            raise DataError(f"cannot read data file: {e}", str(file)) from e

        def read_parquet(rows: int) -> Iterator[Columns]:
            reader = pq.ParquetFile(file)
            # row group by row group: over a whole file, iter_batches reads ahead all of it
            for group in range(reader.metadata.num_row_groups):
                for record in reader.iter_batches(batch_size=rows, row_groups=[group]):
                    yield {
                        name: record.column(name).to_numpy(zero_copy_only=False)
                        for name in record.schema.names
                    }

        return _Source(str(file), n_rows, read_parquet, names)
    if suffix == ".csv":
        from pyarrow import csv

        def read_csv(rows: int) -> Iterator[Columns]:
            # blocks of about 1 MiB: memory stays flat however long the file is
            reader = csv.open_csv(file, read_options=csv.ReadOptions(block_size=1 << 20))
            for record in reader:
                yield {
                    name: record.column(name).to_numpy(zero_copy_only=False)
                    for name in record.schema.names
                }

        try:
            names = csv.open_csv(file).schema.names
        except Exception as e:  # pyarrow's own error types; all mean "unreadable"
            raise DataError(f"cannot read data file: {e}", str(file)) from e
        return _Source(str(file), None, read_csv, names)
    raise DataError(
        f"unsupported data format {suffix!r}; expected one of {', '.join(FORMATS)} or file.py:fn",
        str(file),
    )


def _function_source(spec: str, columns: _Columns) -> _Source:
    """``file.py:fn`` returning a dict of columns, a map-style Dataset or an IterableDataset."""
    made = import_object(spec, "data.path")()
    if isinstance(made, dict):
        return _Source(spec, len(next(iter(made.values()), [])), lambda _: iter([made]))
    names, n_inputs, where = columns.names, columns.n_inputs, spec
    if isinstance(made, torch.utils.data.IterableDataset) or (
        hasattr(made, "__iter__") and not hasattr(made, "__getitem__")
    ):

        def read_iterable(rows: int) -> Iterator[Columns]:
            items: list[Any] = []
            for item in made:
                items.append(item)
                if len(items) == rows:
                    yield _collate(items, names, n_inputs, where)
                    items = []
            if items:
                yield _collate(items, names, n_inputs, where)

        return _Source(where, None, read_iterable)  # an iterable's len() is only a hint
    if hasattr(made, "__getitem__") and hasattr(made, "__len__"):
        n = len(made)

        def read_map(rows: int) -> Iterator[Columns]:
            for lo in range(0, n, rows):
                items = [made[i] for i in range(lo, min(lo + rows, n))]
                yield _collate(items, names, n_inputs, where)

        return _Source(where, n, read_map)
    raise DataError(
        f"{spec} returned a {type(made).__name__}; expected a dict of columns, "
        "a torch Dataset or an IterableDataset",
        "data.path",
    )


def _read(source: _Source, rows: int) -> Iterator[Columns]:
    try:
        yield from source.read(rows)
    except DataError:
        raise
    except Exception as e:  # every reader (and user dataset) has its own error types
        raise DataError(f"cannot read data: {e}", source.where) from e


def shard_paths(path: str | Sequence[str]) -> list[str]:
    """A file, a glob or a list of either -> the files in order (each glob's matches sorted)."""
    specs = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for spec in specs:
        if any(c in spec for c in "*?[") and ".py:" not in spec:
            matches = sorted(glob.glob(spec))
            if not matches:
                raise DataError("no data file matches the pattern", spec)
            files.extend(matches)
        else:
            files.append(spec)
    return files


def code_file(spec: str) -> str | None:
    """The file of a ``file.py:Name`` spec; None for anything else."""
    return spec.rsplit(":", 1)[0] if ".py:" in spec else None


def data_files(path: str | Sequence[str]) -> list[str]:
    """The files a data path reads: each file, each glob's matches, each ``file.py:fn``'s file."""
    return [code_file(spec) or spec for spec in shard_paths(path)]


class Dataset:
    """The configured rows, read source by source in runs so that memory stays flat.

    ``length`` is the number of rows when the sources tell it without being read (Parquet
    footers, a single table, a map-style Dataset), else None.
    """

    def __init__(self, sources: list[_Source], columns: _Columns, where: str):
        self.sources, self.columns, self.where = sources, columns, where
        lengths = [s.length for s in sources]
        self.length = None if None in lengths else sum(lengths)

    def __len__(self) -> int:
        """The number of rows; when not known ahead, found by reading the data once."""
        if self.length is None:
            self.length = sum(len(chunk) for chunk in self._chunks(1 << 16))
        return self.length

    def _chunks(self, rows: int) -> Iterator[Batch]:
        start = 0
        for source in self.sources:
            for columns in _read(source, rows):
                chunk = self.columns.batch(columns, start, source.where)
                start += len(chunk)
                yield chunk
        if start == 0:
            raise DataError("the dataset is empty", self.where)

    def batches(self, batch_size: int, limit: int | None = None) -> Iterator[Batch]:
        """Batches in row order; ``Batch.index`` counts rows across all sources from 0."""
        return _rebatch(self._chunks(batch_size), batch_size, limit)

    def values_at(self, name: str, key: str, positions: set[int]) -> dict[int, Any]:
        """Column ``name`` (the config's ``key``) at the given row positions, read as stored."""
        found: dict[int, Any] = {}
        start = 0
        for source in self.sources:
            for columns in _read(source, 1 << 12):
                if name not in columns:
                    raise DataError(f"no column {name!r} for {key}", source.where)
                values = columns[name]
                found.update(
                    {p: values[p - start] for p in positions if 0 <= p - start < len(values)}
                )
                start += len(values)
        return found


def open_dataset(cfg: DataConfig, path: str | Sequence[str] | None = None) -> Dataset:
    """Open ``path`` (default: ``data.path``) with the columns named in ``cfg``."""
    path = path or cfg.path
    where = path if isinstance(path, str) else ", ".join(path)
    columns = _Columns(cfg.inputs, cfg.targets, cfg.ids)
    sources = []
    for spec in shard_paths(path):
        sources.append(_function_source(spec, columns) if ".py:" in spec else _file_source(spec))
    if len(sources) == 1 and sources[0].whole:
        # a single table read whole anyway: read it now, so its size and columns are known
        only = sources[0]
        (table,) = list(_read(only, 0))
        rows = len(columns.batch(table, 0, only.where))
        sources = [_Source(only.where, rows, lambda _: iter([table]))]
    if sources[0].names is not None:  # the first shard's columns, before any row is read
        columns.check(sources[0].names, sources[0].where)
    dataset = Dataset(sources, columns, where)
    if dataset.length == 0:
        raise DataError("the dataset is empty", where)
    return dataset
