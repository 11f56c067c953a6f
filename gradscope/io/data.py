"""Datasets from files, shards and user functions: streamed in batches, each row keeping its position."""

from __future__ import annotations

import bisect
import glob
import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config import DataConfig
from ..errors import DataError
from .batch import Batch, Columns, rebatch, take
from .model import LFS_POINTER, file_sha256, import_object, lfs_pointer
from .selection import Selection, is_glob

FORMATS = (".pt", ".pth", ".npz", ".parquet", ".csv", ".arrow")


def _collate(items: list[Any], wanted: Selection, where: str) -> Columns:
    """Items of a torch Dataset -> columns: a dict per item, or a tuple (*inputs, target)."""
    first, n_inputs = items[0], wanted.n_inputs
    if isinstance(first, dict):
        names = wanted.names(list(first))
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
        names = [*wanted.specs, wanted.targets]  # ids come only from dict items
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
    from .arrow import arrow_source_parts, record_columns

    file = Path(path)
    if not file.is_file():
        raise DataError("data file not found", str(file))
    if lfs_pointer(file):
        raise DataError(LFS_POINTER, str(file))
    suffix = file.suffix.lower()
    if suffix in (".pt", ".pth"):

        def read_pt(_: int) -> Iterator[Columns]:
            try:
                columns = torch.load(file, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:  # torch's advice runs to eight lines
                raise DataError(
                    "the data file holds objects other than tensors and is not loaded (that "
                    "would run its pickle): save a dict of tensors",
                    str(file),
                ) from e
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
    if suffix == ".arrow":
        return _Source(str(file), *arrow_source_parts(str(file)))
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
                    yield record_columns(record)

        return _Source(str(file), n_rows, read_parquet, names)
    if suffix == ".csv":
        from pyarrow import csv

        def read_csv(rows: int) -> Iterator[Columns]:
            # blocks of about 1 MiB: memory stays flat however long the file is
            reader = csv.open_csv(file, read_options=csv.ReadOptions(block_size=1 << 20))
            for record in reader:
                yield record_columns(record)

        try:
            names = csv.open_csv(file).schema.names
        except Exception as e:  # pyarrow's own error types; all mean "unreadable"
            raise DataError(f"cannot read data file: {e}", str(file)) from e
        return _Source(str(file), None, read_csv, names)
    raise DataError(
        f"unsupported data format {suffix!r}; expected one of {', '.join(FORMATS)} or file.py:fn",
        str(file),
    )


def _function_source(spec: str, columns: Selection) -> _Source:
    """``file.py:fn`` returning a dict of columns, a map-style Dataset or an IterableDataset."""
    made = import_object(spec, "data.path")()
    if isinstance(made, dict):
        return _Source(spec, len(next(iter(made.values()), [])), lambda _: iter([made]))
    where = spec
    if isinstance(made, torch.utils.data.IterableDataset) or (
        hasattr(made, "__iter__") and not hasattr(made, "__getitem__")
    ):

        def read_iterable(rows: int) -> Iterator[Columns]:
            items: list[Any] = []
            for item in made:
                items.append(item)
                if len(items) == rows:
                    yield _collate(items, columns, where)
                    items = []
            if items:
                yield _collate(items, columns, where)

        return _Source(where, None, read_iterable)  # an iterable's len() is only a hint
    if hasattr(made, "__getitem__") and hasattr(made, "__len__"):
        n = len(made)

        def read_map(rows: int) -> Iterator[Columns]:
            for lo in range(0, n, rows):
                items = [made[i] for i in range(lo, min(lo + rows, n))]
                yield _collate(items, columns, where)

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
    """A file, a glob, a ``save_to_disk`` folder or a list of them -> the files in order (each
    glob's matches sorted, a folder's .arrow files in the dataset's order)."""
    specs = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for spec in specs:
        if Path(spec).is_dir():
            from .arrow import arrow_files

            files.extend(arrow_files(Path(spec)))
        elif is_glob(spec) and ".py:" not in spec and not Path(spec).exists():
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
    """The files and folders a data path reads: each file, each glob's matches, each
    ``save_to_disk`` folder whole (its ``state.json`` too), each ``file.py:fn``'s file. Read
    nothing: a glob that matches nothing or an unreadable folder is its reader's to report."""
    specs = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for spec in specs:
        if code_file(spec):
            files.append(code_file(spec))
        elif is_glob(spec) and not Path(spec).exists():
            files.extend(sorted(glob.glob(spec)))
        else:
            files.append(spec)
    return files


def data_sha256(path: str | Sequence[str]) -> str | None:
    """The sha256 of a data file; of a folder, glob or list, one over its files' names and hashes
    in order; None for ``file.py:fn`` and for a missing file (its reader reports it)."""
    files = shard_paths(path)
    if any(".py:" in f for f in files):
        return None
    if files == [path]:
        return file_sha256(path) if Path(path).is_file() else None
    listing = "\n".join(f"{f} {file_sha256(f)}" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()


class Dataset:
    """The configured rows, read source by source in runs so that memory stays flat.

    ``length`` is the number of rows when the sources tell it without being read (Parquet
    footers, a single table, a map-style Dataset), else None.
    """

    def __init__(self, sources: list[_Source], columns: Selection, where: str):
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

    def batches(
        self, batch_size: int, limit: int | None = None, pad: bool = True
    ) -> Iterator[Batch]:
        """Batches in row order; ``Batch.index`` counts rows across all sources from 0. The
        columns in ``data.pad`` are padded to the batch's longest row, or with ``pad=False`` kept
        as each row's array as stored."""
        cut = rebatch(self._chunks(batch_size), batch_size, limit)
        return (self.columns.padded(batch) for batch in cut) if pad else cut

    def rows_at(self, positions: Sequence[int], batch_size: int) -> Iterator[Batch]:
        """The rows at ``positions`` (0-based, sorted, distinct), in dataset order, in batches
        padded as ``batches`` pads them: one pass over the data that keeps only those rows."""
        wanted = list(positions)

        def picked() -> Iterator[Batch]:
            for chunk in self._chunks(1 << 12):
                first = int(chunk.index[0])
                lo = bisect.bisect_left(wanted, first)
                hi = bisect.bisect_left(wanted, first + len(chunk))
                if hi > lo:
                    yield take(chunk, torch.tensor(wanted[lo:hi]) - first)
                if hi == len(wanted):
                    return

        return (self.columns.padded(b) for b in rebatch(picked(), batch_size, None))

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
    columns = Selection(cfg.inputs, cfg.targets, cfg.ids, cfg.pad)
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
