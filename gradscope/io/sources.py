"""Where rows come from: one ``Source`` per shard, a file of a known format here (rows held in
Python, a ``file.py:fn``'s among them: ``objects.py``), each read in runs of rows."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, raised
from .batch import Columns
from .files import LFS_POINTER, lfs_pointer

FORMATS = (".pt", ".pth", ".npz", ".parquet", ".csv", ".arrow")


@dataclass
class Source:
    """One shard: ``length`` rows (None until read) and a way to read it in runs of rows."""

    where: str
    length: int | None
    read: Callable[[int], Iterator[Columns]]  # rows per run -> runs of rows
    names: list[str] | None = None  # the columns, when known without reading the rows
    whole: bool = False  # read in one piece (.pt, .npz): its size is known only once read


def file_source(path: str, what: str = "data file", ids: str | None = None) -> Source:
    """The file at ``path`` as a Source, by its suffix (FORMATS); ``what`` names it in errors.
    A CSV's ``ids`` column is read as the text it holds (no number guessed from it)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{what} not found", str(file))
    if lfs_pointer(file):
        raise DataError(LFS_POINTER, str(file))
    suffix = file.suffix.lower()
    readers = {".pt": _pt, ".pth": _pt, ".npz": _npz, ".arrow": _arrow, ".parquet": _parquet,
               ".csv": _csv}  # fmt: skip
    if suffix not in readers:
        raise DataError(
            f"unsupported data format {suffix!r}; expected one of {', '.join(FORMATS)} or "
            "file.py:fn",
            str(file),
        )
    return _csv(file, ids) if suffix == ".csv" else readers[suffix](file)


def _pt(file: Path) -> Source:
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

    return Source(str(file), None, read_pt, whole=True)


def _npz(file: Path) -> Source:
    def read_npz(_: int) -> Iterator[Columns]:
        with np.load(file, allow_pickle=False) as npz:
            yield {k: npz[k] for k in npz.files}

    return Source(str(file), None, read_npz, whole=True)


def _arrow(file: Path) -> Source:
    from .arrow import arrow_source_parts

    return Source(str(file), *arrow_source_parts(str(file)))


def _parquet(file: Path) -> Source:
    import pyarrow.parquet as pq

    from .arrow import record_columns

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

    return Source(str(file), n_rows, read_parquet, names)


def _csv(file: Path, ids: str | None = None) -> Source:
    import pyarrow as pa
    from pyarrow import csv

    from .arrow import record_columns

    # ids as written: "007" and "7" are two ids, 20-digit ones are not rounded into one float
    text = csv.ConvertOptions(column_types={ids: pa.string()} if ids else {})

    def read_csv(rows: int) -> Iterator[Columns]:
        # blocks of about 1 MiB: memory stays flat however long the file is
        options = csv.ReadOptions(block_size=1 << 20)
        reader = csv.open_csv(file, read_options=options, convert_options=text)
        for record in reader:
            yield record_columns(record)

    try:
        names = csv.open_csv(file).schema.names
    except Exception as e:  # pyarrow's own error types; all mean "unreadable"
        raise DataError(f"cannot read data file: {e}", str(file)) from e
    return Source(str(file), None, read_csv, names)


def read_source(source: Source, rows: int) -> Iterator[Columns]:
    try:
        yield from source.read(rows)
    except DataError:
        raise
    except Exception as e:  # every reader (and user dataset) has its own error types
        if os.path.isfile(source.where) and not os.path.getsize(source.where):
            raise DataError("the data file is empty (0 bytes)", source.where) from e
        raise DataError(f"cannot read data: {raised(e)}", source.where) from e
