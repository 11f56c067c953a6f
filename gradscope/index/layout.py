"""The index on disk: a folder that numpy, torch and Arrow read without gradscope.

    INDEX/
      manifest.json      format, rows, width, dtype, the shards in order (each with the sha256
                         of its first and last rows and the CRC-32 of all of them, which a
                         query checks as it streams them), the projection (seed, one block of
                         columns per parameter) and the run's metadata
      ids.parquet        one row per indexed example, in index order: example_id, id (with
                         data.ids), loss, norm (= ||phi_i||, float64), finite; its metadata
                         holds the manifest's sha256 (the seal, see ``manifest.py``)
      shard-000000.npy   (rows, width) float16 (or float32): row i is phi_i / ||phi_i|| (zeros
      shard-000001.npy   where norm is 0 or finite is false); each a .npy file whose header is
      ...                exactly 128 bytes, the rows following it in C order

So ``phi_i = norm_i * row_i``: unit rows keep float16's precision for every example, however
large or small its gradient. Readers:

    np.load(shard, mmap_mode="r")                                   # numpy, memory-mapped
    torch.from_file(shard, size=64 + rows * width, dtype=torch.float16)[64:].view(rows, width)
    pa.Array.from_buffers(pa.float16(), rows * width,               # Arrow, zero copy
                          [None, pa.memory_map(shard).read_buffer()[128:]])

A run writes ``.INDEX.partial/`` as ``norms`` does (one stamped Parquet part per batch, the
rows in a fixed-size binary column, for ``--resume`` and torchrun ranks), then assembles the
folder beside the parts and moves it into place: a folder at INDEX is always a whole index.
A run killed while assembling leaves the half-made folder in the partial one, where the next run
removes it (``reader.py`` reads an index).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ConfigError, DataError
from ..inputs import Inputs, check_folder, check_not_input
from ..io.atomic import replace_atomically
from ..io.parquet import RUN_FILE, PartialRun
from .manifest import FORMAT, HEADER, IDS, MANIFEST, SEAL, VERSION, ends_sha256, read_manifest, seal

STAGING = "index"  # the folder inside the partial one where the index is assembled
INDEX_FILE = re.compile(r"manifest\.json|ids\.parquet|shard-\d{6}\.npy")  # what a run writes
ROWS = "rows"  # the column of a part holding the rows' bytes
SHARD_BYTES = 1 << 30  # a shard holds at most this many bytes of rows


def npy_header(rows: int, width: int, dtype: np.dtype) -> bytes:
    """A .npy (version 1.0) header of exactly ``HEADER`` bytes for (rows, width) ``dtype``."""
    spec = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (rows, width)}
    text = repr(spec).encode("latin1")
    return (
        b"\x93NUMPY\x01\x00" + (HEADER - 10).to_bytes(2, "little") + text.ljust(HEADER - 11) + b"\n"
    )


def row_bytes(rows: np.ndarray) -> pa.Array:
    """(B, width) rows as a fixed-size binary Arrow array, one value per row, no copy."""
    rows = np.ascontiguousarray(rows)
    size = rows.shape[1] * rows.itemsize
    return pa.Array.from_buffers(pa.binary(size), len(rows), [None, pa.py_buffer(rows)])


class ShardWriter:
    """Rows appended in order into ``shard-NNNNNN.npy`` files of at most ``SHARD_BYTES``."""

    def __init__(self, folder: Path, width: int, dtype: np.dtype):
        self.folder, self.width, self.dtype = folder, width, np.dtype(dtype)
        self.limit = max(1, SHARD_BYTES // max(1, width * self.dtype.itemsize))
        self.shards: list[dict[str, Any]] = []
        self._file, self._rows, self._first, self._crc = None, 0, 0, 0

    def add(self, data: memoryview | bytes, rows: int) -> None:
        """``rows`` rows' bytes, in order."""
        size, done = self.width * self.dtype.itemsize, 0
        while done < rows:
            if self._file is None:
                name = f"shard-{len(self.shards):06d}.npy"
                self._file = open(self.folder / name, "w+b")  # noqa: SIM115 (closed in _close)
                self._file.write(npy_header(0, self.width, self.dtype))
                self.shards.append({"file": name, "rows": 0, "first": self._first})
                self._crc = 0
            n = min(rows - done, self.limit - self._rows)
            block = data[done * size : (done + n) * size]
            self._file.write(block)
            self._crc = zlib.crc32(block, self._crc)
            done, self._rows = done + n, self._rows + n
            if self._rows == self.limit:
                self._close()

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.write(npy_header(self._rows, self.width, self.dtype))
        size = self._rows * self.width * self.dtype.itemsize
        self.shards[-1]["ends_sha256"] = ends_sha256(self._file, size)
        self.shards[-1]["crc32"] = self._crc  # of all its rows: checked as a query reads them
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1]["rows"] = self._rows
        self._file, self._first, self._rows = None, self._first + self._rows, 0

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self.shards


class IndexRun(PartialRun):
    """The partial folder of an index run, assembled into the index folder at the end."""

    def assemble(
        self, parts: int, metadata: dict[str, Any], more: Callable[[], dict] = dict
    ) -> Path:
        """Parts ``0 .. parts-1`` in order into the shards, ``ids.parquet`` and the manifest,
        written in a folder inside the partial one, then moved to ``path``; an index there
        before (``check_output`` allowed no other folder) is replaced."""
        self.check_complete(parts)
        projection = metadata.pop("index")
        dtype = np.dtype(projection.pop("storage"))
        staging = self.dir / STAGING
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        shards, schema, rows = ShardWriter(staging, projection["width"], dtype), self._ids(parts), 0
        with pq.ParquetWriter(staging / IDS, schema) as ids:
            for number in range(parts):
                table = pq.read_table(self._part(number))
                data = table.column(ROWS).combine_chunks()
                shards.add(memoryview(data.buffers()[1])[data.offset * data.type.byte_width :],
                           len(table))  # fmt: skip
                ids.write_table(table.drop_columns([ROWS]).cast(schema))
                rows += len(table)
            text = _manifest(rows, dtype, shards.finish(), projection, metadata)
            ids.add_key_value_metadata({SEAL: seal(text)})
        replace_atomically(staging / MANIFEST, lambda f: f.write(text), "the index")
        _publish(staging, self.path)
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.path

    def refuse_foreign(self) -> None:
        """As a run's partial folder, and the index a killed run was assembling in it: a fresh
        run removes it with the rest, ``--resume`` assembles it again."""
        staging = self.dir / STAGING
        if not (self.dir.is_symlink() or staging.is_symlink()) and staging.is_dir():
            names = [f.name for f in staging.iterdir()]
            if all(INDEX_FILE.fullmatch(n) or RUN_FILE.fullmatch(n) for n in names):
                shutil.rmtree(staging)
        super().refuse_foreign()

    def _ids(self, parts: int) -> pa.Schema:
        """The parts' columns but the rows, in the type that holds every part's (an ``id``
        column of whole numbers in one CSV shard), as assembling scores does."""
        schemas = [pq.read_schema(self._part(n)).remove_metadata() for n in range(parts)]
        try:
            schema = pa.unify_schemas(schemas, promote_options="permissive")
        except (pa.ArrowException, ValueError) as e:
            raise DataError(f"the batches' ids do not fit one table: {e}", str(self.dir)) from e
        return schema.remove(schema.get_field_index(ROWS))


def _manifest(rows: int, dtype: np.dtype, shards: list, projection: dict, metadata: dict) -> bytes:
    """The manifest's bytes."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "rows": rows,
        "width": projection["width"],
        "dtype": dtype.name,
        "header_bytes": HEADER,
        "shards": shards,
        "ids": IDS,
        "projection": projection,
        "gradscope": metadata,
    }
    return json.dumps(manifest, indent=1, default=str).encode()


def former(path: Path) -> Path:
    """Where a rebuild moves the index it replaces (``.INDEX.old``), for the moment between the
    two renames: a run killed then leaves the former index there, which the next run removes."""
    return path.with_name(f".{path.name}.old")


def _publish(staging: Path, path: Path) -> None:
    """``staging`` renamed to ``path``; a former index there renamed away first, then removed
    (``check_output`` allowed nothing but an index at either name)."""
    old = former(path)
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.rename(path, old)
    os.rename(staging, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def _is_index(path: Path) -> bool:
    """Whether ``path`` is an index folder (of any version, damaged or not) holding nothing but
    the files an index run writes: one a run may replace."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return False
    ours = all(  # files of an index's names, not a folder or link that holds others
        INDEX_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink() for p in path.iterdir()
    )
    return ours and isinstance(manifest, dict) and manifest.get("format") == FORMAT


def check_output(path: str | Path, inputs: Inputs) -> None:
    """Refuse, before anything runs, an index folder that is one of the inputs or inside one,
    or a path holding anything but a gradscope index (which the run replaces)."""
    path = Path(path)
    check_not_input(path, inputs)
    for at in (path, former(path)):
        if at.is_symlink() or (at.exists() and not (at.is_dir() and _is_index(at))):
            raise ConfigError(
                "the output path exists and is not a gradscope index folder (or holds other "
                "files too); writing there would replace it, choose another --out",
                str(at),
            )
    check_folder(path)


def described(path: str | Path) -> str:
    """One line on an index: its rows, their width and size, its shards."""
    m = read_manifest(path)
    size = m["width"] * np.dtype(m["dtype"]).itemsize
    shards = len(m["shards"])
    return (
        f"{m['rows']} examples, {m['width']} numbers each ({m['dtype']}: {size:,} bytes an "
        f"example), in {shards} shard{'s' if shards != 1 else ''}"
    )
