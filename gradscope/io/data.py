"""Datasets from files, shards and user functions: streamed in batches, each row keeping its position."""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import glob
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import DataConfig
from ..errors import DataError, stop_if_signalled
from .batch import Batch, batch_sha256, rebatch, take
from .files import file_sha256
from .held import held, is_held
from .objects import function_source, object_source
from .selection import Selection, is_glob
from .sources import Source, file_source, read_source


def shard_paths(path: str | Sequence[str], what: str = "data file") -> list[str]:
    """A file, a glob, a ``save_to_disk`` folder or a list of them -> the files in order (each
    glob's matches sorted, a folder's .arrow files in the dataset's order). ``what`` names the
    files in errors."""
    specs = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for spec in specs:
        if Path(spec).is_dir():
            from .arrow import arrow_files

            files.extend(arrow_files(Path(spec)))
        elif is_glob(spec) and ".py:" not in spec and not Path(spec).exists():
            matches = sorted(glob.glob(spec))
            if not matches:
                raise DataError(f"no {what} matches the pattern", spec)
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


def made_by_code(path: str | Sequence[str]) -> bool:
    """Whether code makes any of the data at ``path`` (a ``file.py:fn``, rows held in Python):
    rows that no file's sha256 holds."""
    specs = [path] if isinstance(path, str) else list(path)
    return any(code_file(spec) or is_held(spec) for spec in specs)


HASHED_ROWS = 4096  # rows a source reads at once for a hash, whatever data.batch_size is


def code_rows_sha256(cfg: DataConfig, path: str | Sequence[str] | None = None) -> str | None:
    """Where code makes the data at ``path`` (default: ``data.path``; a ``file.py:fn``, rows
    held in Python): the sha256 of its rows up to ``data.limit`` (a stream may have no end),
    their ids left out, one pass over them, since the files that code reads are named nowhere;
    a ``path`` given (REF) is read whole. None where files hold the data: their sha256
    (``data_sha256``) is the data's."""
    if path is not None:  # REF: no limit
        cfg = dataclasses.replace(cfg, limit=None)
    path = path or cfg.path
    if not made_by_code(path):
        return None
    h = hashlib.sha256()
    rows = open_dataset(dataclasses.replace(cfg, ids=None), path)
    with torch.random.fork_rng(devices=[]):  # what the code draws is not the caller's to lose
        for run in rows.runs(cfg.limit):
            h.update(batch_sha256(run).encode())
    return f"rows:{h.hexdigest()}"


def code_rows_key(cfg: DataConfig) -> dict[str, str]:
    """What a run's key adds for data made by code (``code_rows_sha256``); nothing for files,
    so keys over files stay as they were."""
    made = code_rows_sha256(cfg)
    return {"data made by code": made} if made else {}


def data_identity(cfg: DataConfig, path: str | Sequence[str] | None = None) -> str | None:
    """The sha256 that stands for the data at ``path`` (default: ``data.path``; REF's, read
    whole): its files' (``data_sha256``), or where code makes it, its rows' up to
    ``data.limit`` (``code_rows_sha256``)."""
    return data_sha256(path or cfg.path) or code_rows_sha256(cfg, path)


class Dataset:
    """The configured rows, read source by source in runs so that memory stays flat.

    ``length`` is the number of rows when the sources tell it without being read (Parquet
    footers, a single table, a map-style Dataset), else None.
    """

    def __init__(self, sources: list[Source], columns: Selection, where: str):
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
            for columns in read_source(source, rows):
                chunk = self.columns.batch(columns, start, source.where)
                start += len(chunk)
                yield chunk
        if start == 0:
            raise DataError("the dataset is empty", self.where)

    def runs(self, limit: int | None = None) -> Iterator[Batch]:
        """The rows up to ``limit`` in the runs their sources give (a DataLoader's batches as
        it collates them, of any width), unpadded: what ``code_rows_sha256`` hashes."""
        seen = 0
        for chunk in self._chunks(HASHED_ROWS):
            if limit is not None and seen + len(chunk) >= limit:
                yield take(chunk, torch.arange(limit - seen))
                return
            seen += len(chunk)
            yield chunk

    def batches(
        self, batch_size: int, limit: int | None = None, pad: bool = True
    ) -> Iterator[Batch]:
        """Batches in row order; ``Batch.index`` counts rows across all sources from 0. The
        columns in ``data.pad`` are padded to the batch's longest row, or with ``pad=False`` kept
        as each row's array as stored."""
        cut = _checked(rebatch(self._chunks(batch_size), batch_size, limit))
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
            for columns in read_source(source, 1 << 12):
                if name not in columns:
                    raise DataError(f"no column {name!r} for {key}", source.where)
                values = columns[name]
                found.update(
                    {p: values[p - start] for p in positions if 0 <= p - start < len(values)}
                )
                start += len(values)
        return found


def _text_ids(cfg: DataConfig) -> str | None:
    """``data.ids``, where only the ids read it: a CSV's is read as text then, not where it is
    the targets or an input too (numbers there)."""
    specs = cfg.inputs.values() if isinstance(cfg.inputs, dict) else cfg.inputs
    names = [cfg.targets, *(n for s in specs for n in ([s] if isinstance(s, str) else s))]
    return None if any(fnmatch.fnmatchcase(cfg.ids or "", n) for n in names) else cfg.ids


def open_dataset(
    cfg: DataConfig, path: str | Sequence[str] | None = None, key: str = "data.path"
) -> Dataset:
    """Open ``path`` (default: ``data.path``) with the columns named in ``cfg``; ``key`` is the
    option that names it (``--ref``), as errors name it."""
    path = path or cfg.path
    what = "data file" if key == "data.path" else f"{key} file"
    where = path if isinstance(path, str) else ", ".join(path)
    columns = Selection(cfg.inputs, cfg.targets, cfg.ids, cfg.pad, cfg.pad_targets)
    sources = []
    for spec in shard_paths(path, what):
        if is_held(spec):  # the rows a Python caller passed in
            sources.append(object_source(held(spec), columns, spec))
        elif ".py:" in spec:
            sources.append(function_source(spec, columns, key))
        else:
            sources.append(file_source(spec, what, _text_ids(cfg)))
    if len(sources) == 1 and sources[0].whole:
        # a single table read whole anyway: read it now, so its size and columns are known
        only = sources[0]
        (table,) = list(read_source(only, 0))
        rows = len(columns.batch(table, 0, only.where))
        sources = [Source(only.where, rows, lambda _: iter([table]))]
    if sources[0].names is not None:  # the first shard's columns, before any row is read
        columns.check(sources[0].names, sources[0].where)
    dataset = Dataset(sources, columns, where)
    if dataset.length == 0:
        raise DataError("the dataset is empty", where)
    return dataset


def _checked(batches: Iterator[Batch]) -> Iterator[Batch]:
    """``batches``, stopped before the next one once a signal arrived that torch turned into
    another error and a fallback took in (``errors.on_signal``)."""
    for batch in batches:
        stop_if_signalled()
        yield batch
