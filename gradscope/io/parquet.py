"""Scores to Parquet: one part file per batch in a partial folder, assembled into place at the end.

A run writes ``.NAME.partial/``: ``manifest.json`` (what is being computed, for ``--resume``) and
``part-<batch>.parquet``, each written under a temporary name of its own, fsync'd and renamed when
complete, so a run killed at any instant (kill -9, power loss) leaves only whole parts behind; a
part that does not read back is rescored on resume. Assembly copies the parts in batch order, one
row group each, into ``NAME``; a file at ``NAME`` is always a finished run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError

METADATA_KEY = b"gradscope"
MANIFEST = "manifest.json"


def partial_path(path: str | Path) -> Path:
    """Where a run writes until it completes."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def arrow_type(values: Any) -> pa.DataType:
    """The Arrow type of a numpy array or a tensor (torch is not imported here: ``summary``)."""
    dtype = values.dtype if isinstance(values, np.ndarray) else values.numpy().dtype
    return pa.string() if dtype.kind in "OUS" else pa.from_numpy_dtype(dtype)


def _sync_folder(folder: Path) -> None:
    """Make the renames inside ``folder`` durable (a power loss keeps them)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """``write(file)`` to a temporary name of this process's own, fsync, rename over ``path``:
    readers see the old file or the whole new one. A failed write (a full disk) leaves nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_folder(path.parent)
    except OSError as e:  # pyarrow's IO errors are OSErrors too
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write the scores: {e.strerror or e}", str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _readable(part: Path) -> bool:
    """Whether a part's footer reads back: a 0-byte or truncated file does not."""
    try:
        return pq.read_metadata(part).num_rows > 0
    except (OSError, pa.ArrowException):
        return False


class PartialRun:
    """The partial folder of the run that writes ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.dir = partial_path(self.path)

    def manifest(self) -> dict[str, Any] | None:
        """What the partial run computes, or None when there is no partial run to continue."""
        try:
            return json.loads((self.dir / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            return None  # no run, or one killed before its first part: nothing to keep

    def start(self, manifest: dict[str, Any]) -> None:
        """Begin afresh: any earlier partial state is removed."""
        if self.dir.is_file():  # left by the earlier single-file writer
            self.dir.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.mkdir(parents=True)
        except OSError as e:
            raise DataError(f"cannot write the scores: {e.strerror or e}", str(self.dir)) from e
        text = json.dumps(manifest, default=str).encode()
        _replace_atomically(self.dir / MANIFEST, lambda f: f.write(text))

    def done(self) -> set[int]:
        """The batch numbers whose parts are complete; a part that does not read back (a power
        loss before its data reached the disk) is removed, to be scored again."""
        numbers = set()
        for part in self.dir.glob("part-*.parquet"):
            if _readable(part):
                numbers.add(int(part.name[5:-8]))
            else:
                part.unlink()
        return numbers

    def _part(self, number: int) -> Path:
        return self.dir / f"part-{number:09d}.parquet"

    def write(self, number: int, columns: dict[str, Any]) -> None:
        """Batch ``number``'s rows as one complete part file."""
        table = pa.table({name: pa.array(v, type=arrow_type(v)) for name, v in columns.items()})
        _replace_atomically(self._part(number), lambda f: pq.write_table(table, f))

    def names(self) -> list[str]:
        """The columns of the parts."""
        return pq.read_schema(self._part(0)).names

    def column(self, name: str, parts: int) -> np.ndarray | None:
        """Column ``name`` of parts ``0 .. parts-1`` in order; None when the parts lack it."""
        if parts == 0 or name not in self.names():
            return None
        chunks = [pq.read_table(self._part(n), columns=[name]).column(0) for n in range(parts)]
        return np.concatenate([c.to_numpy() for c in chunks])

    def assemble(
        self,
        parts: int,
        metadata: dict[str, Any],
        more: Callable[[], dict[str, np.ndarray]] = dict,
    ) -> Path:
        """Parts ``0 .. parts-1`` in order, one row group each, into ``path`` with ``metadata``
        under the ``gradscope`` key, and the columns ``more()`` computes from the whole parts
        (one value a row) before ``finite``; the folder goes."""
        missing = sorted(set(range(parts)) - self.done())
        if missing:
            raise DataError(
                f"the partial run lacks batch {missing[0]}; run again without --resume",
                str(self.dir),
            )
        first = pq.read_schema(self._part(0))
        extra = more()
        at = first.get_field_index("finite") if "finite" in first.names else len(first)
        for name in reversed(list(extra)):
            first = first.insert(at, pa.field(name, arrow_type(extra[name])))
        schema = first.with_metadata({METADATA_KEY: json.dumps(metadata, default=str)})

        def write(f: Any) -> None:
            start = 0
            with pq.ParquetWriter(f, schema) as writer:
                for number in range(parts):
                    table = pq.read_table(self._part(number))
                    stop = start + len(table)
                    for name in reversed(list(extra)):
                        table = table.add_column(at, name, pa.array(extra[name][start:stop]))
                    # one part's column may read back as another type (an all-null id column)
                    writer.write_table(table.cast(schema))
                    start = stop

        _replace_atomically(self.path, write)
        shutil.rmtree(self.dir)
        return self.path


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``gradscope`` metadata of a scores file."""
    raw = pq.read_schema(path).metadata or {}
    return json.loads(raw[METADATA_KEY]) if METADATA_KEY in raw else {}
