"""An index folder opened for reading: every file read through one handle on the folder, so a
query reads one build's files, never a mix of two, even while the index is rebuilt in place.

A rebuild renames a whole new folder into place and removes the former one: a query holding the
former folder reads it to the end, or, where a file it still needs is gone, stops and says so.
Nothing outside the folder is read (names are plain file names, links are not followed), and no
shard is loaded before its .npy header is checked against the manifest: an object array (a
pickle) is refused unread.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError
from .manifest import HEADER, IDS_COLUMNS, MANIFEST, SEAL, ends_sha256, parse, seal

# no link followed; a FIFO (or device) opened without waiting for a writer, then refused
FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
FLAGS |= getattr(os, "O_NONBLOCK", 0)
# IDS_COLUMNS' types: example_id, loss, norm, finite
IDS_KINDS = (pa.types.is_integer, pa.types.is_floating, pa.types.is_floating, pa.types.is_boolean)


class Shards:
    """An index's manifest, ids and rows, read shard by shard in chunks of at most ``rows`` rows
    into one buffer: the memory a query holds does not grow with the index. Close it (``with``)
    to let go of the folder."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._folder = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise DataError("not a gradscope index folder (no such folder)", str(path)) from e
        try:
            with self._open(MANIFEST) as f:
                text = f.read()
            self.manifest = parse(text, self._where(MANIFEST))
            self.rows, self.width = self.manifest["rows"], self.manifest["width"]
            self.dtype = np.dtype(self.manifest["dtype"])
            self._ids_file = self._open(self.manifest["ids"])
            self._ids = self._open_ids(self._ids_file, seal(text))
            for shard in self.manifest["shards"]:
                self._shard(shard).close()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self._ids_file.close()  # (a ParquetFile leaves a file object it was given open)
        with contextlib.suppress(OSError):
            os.close(self._folder)

    def _where(self, name: str) -> str:
        return str(self.path / name)

    def _open(self, name: str) -> BinaryIO:
        """The file ``name`` of the folder this query opened, a plain file."""
        try:
            fd = os.open(name, FLAGS, dir_fd=self._folder)
        except FileNotFoundError as e:
            if self._replaced():
                raise DataError(
                    "the index was rebuilt or removed while this query read it; nothing was "
                    "written: run the query again",
                    str(self.path),
                ) from e
            raise DataError(f"{name} is missing from the index", self._where(name)) from e
        except OSError as e:
            why = (
                "is a symbolic link; an index reads only its own plain files"
                if e.errno == errno.ELOOP
                else f"cannot be read: {e.strerror or e}"
            )
            raise DataError(f"{name} {why}", self._where(name)) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO: before reading it
            os.close(fd)
            raise DataError(f"{name} is not a plain file", self._where(name))
        return os.fdopen(fd, "rb")

    def _replaced(self) -> bool:
        """Whether the folder at ``path`` is no longer the one this query opened."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        held = os.fstat(self._folder)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def _open_ids(self, f: BinaryIO, sealed: bytes) -> pq.ParquetFile:
        """``ids.parquet`` (open as ``f``), checked: Parquet, the manifest's rows, the columns a
        query reads, and the manifest's seal."""
        name = self.manifest["ids"]
        try:
            ids = pq.ParquetFile(f)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{name} is not a readable Parquet file: {e}", self._where(name)) from e
        missing = [c for c in IDS_COLUMNS if c not in ids.schema_arrow.names]
        if ids.metadata.num_rows != self.rows or missing:
            got = f"lacks column {missing[0]}" if missing else f"holds {ids.metadata.num_rows} rows"
            raise DataError(f"{name} {got}; the manifest has {self.rows}", self._where(name))
        types = {c: ids.schema_arrow.field(c).type for c in IDS_COLUMNS}
        for column, kind in zip(IDS_COLUMNS, IDS_KINDS, strict=True):
            if not kind(types[column]):
                raise DataError(
                    f"{name}'s column {column} holds {types[column]}, not what an index writes",
                    self._where(name),
                )
        if (ids.metadata.metadata or {}).get(SEAL) != sealed:
            raise DataError(
                f"{MANIFEST} is not the one this index was built with ({name} records another "
                "sha256): copied from another index, or edited; build the index again",
                self._where(MANIFEST),
            )
        return ids

    @property
    def columns(self) -> list[str]:
        """The columns of ``ids.parquet``."""
        return self._ids.schema_arrow.names

    def ids(self, columns: list[str] | None = None) -> pa.Table:
        """Columns of ``ids.parquet``, from the file this query opened."""
        try:
            return self._ids.read(columns=columns)
        except (OSError, pa.ArrowException) as e:
            name = self.manifest["ids"]
            raise DataError(f"{name} cannot be read: {e}", self._where(name)) from e

    def _shard(self, shard: dict) -> BinaryIO:
        """Shard ``shard``'s file at its first row, its header checked against the manifest."""
        name, where = shard["file"], self._where(shard["file"])
        f = self._open(name)
        try:
            if np.lib.format.read_magic(f) != (1, 0):
                raise ValueError("not a version 1.0 .npy header")
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        except ValueError as e:
            f.close()
            raise DataError(f"{name} is not a .npy file of index rows: {e}", where) from e
        expected = HEADER + shard["rows"] * self.width * self.dtype.itemsize
        if dtype.hasobject:
            why = "holds Python objects (a pickle), refused unread"
        elif (shape, fortran, dtype, f.tell()) != ((shard["rows"], self.width), False, self.dtype,
                                                   HEADER):  # fmt: skip
            why = (
                f"is a {'Fortran-order ' if fortran else ''}{shape} {dtype} array, the manifest "
                f"says ({shard['rows']}, {self.width}) {self.dtype.name} with a {HEADER}-byte header"
            )
        elif os.fstat(f.fileno()).st_size != expected:
            why = f"holds {os.fstat(f.fileno()).st_size} bytes, its rows and header take {expected}"
        elif ends_sha256(f, expected - HEADER) != shard["ends_sha256"]:
            why = "is not the shard this index was built with (its rows are not the ones recorded)"
        else:
            f.seek(HEADER)
            return f
        f.close()
        raise DataError(f"{name} {why}", where)

    def chunks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, (n, width) rows), in index order; each chunk's array is reused for the
        next, so read it before asking for the next."""
        buffer = np.empty((min(rows, max(1, self.rows)), self.width), self.dtype)
        for shard in self.manifest["shards"]:
            name, crc = shard["file"], 0
            with self._shard(shard) as f:
                for lo in range(0, shard["rows"], len(buffer)):
                    chunk = buffer[: min(len(buffer), shard["rows"] - lo)]
                    if f.readinto(memoryview(chunk).cast("B")) != chunk.nbytes:
                        raise DataError(f"{name} ended early", self._where(name))
                    crc = zlib.crc32(memoryview(chunk).cast("B"), crc)
                    if lo + len(chunk) == shard["rows"] and crc != shard["crc32"]:
                        raise DataError(  # before its last chunk is scored: no output written
                            f"{name} is damaged: its rows are not the ones written (their CRC-32 "
                            "differs from the manifest's); build the index again",
                            self._where(name),
                        )
                    yield shard["first"] + lo, chunk
