"""Scores to Parquet: one part file per batch in a partial folder, assembled into place at the end.

A run writes ``.NAME.partial/``: ``manifest.json`` (what is being computed, for ``--resume``) and
``part-<batch>.parquet``, each written under a temporary name of its own, fsync'd and renamed when
complete, so a run killed at any instant (kill -9, power loss) leaves only whole parts behind; a
part that does not read back is rescored on resume. Assembly copies the parts in batch order, one
row group each, into ``NAME``; a file at ``NAME`` is always a finished run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError, one_line
from .atomic import replace_atomically

METADATA_KEY = b"gradscope"
MANIFEST = "manifest.json"
RUN_KEY = b"gradscope_run"  # in each part: the sha256 of its run's fingerprint
PART_KEY = b"gradscope_part"  # and its batch number: a part copied to another name is not it
DATA_KEY = b"gradscope_data"  # where no file's hash holds the data: its batch's sha256
# what a run writes in its partial folder: the manifest, the parts (or a training run's state),
# their temporary names
RUN_FILE = re.compile(r"\.?(manifest\.json|part-\d+\.parquet|state\.pt)(.*\.tmp)?")


def saved_rows(folder: Path) -> int:
    """The rows of the part files in a partial folder whose footers read back."""
    rows = 0
    for part in folder.glob("part-*.parquet"):
        with contextlib.suppress(OSError, pa.ArrowException):
            rows += pq.read_metadata(part).num_rows
    return rows


def partial_path(path: str | Path) -> Path:
    """Where a run writes until it completes."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def arrow_type(values: Any) -> pa.DataType:
    """The Arrow type of a numpy array or a tensor (torch is not imported here: ``summary``)."""
    dtype = values.dtype if isinstance(values, np.ndarray) else values.numpy().dtype
    return pa.string() if dtype.kind in "OUS" else pa.from_numpy_dtype(dtype)


class PartialRun:
    """The partial folder of the run that writes ``path`` with resume ``fingerprint``.

    Each part carries the sha256 of the fingerprint in its metadata: a part that another run
    wrote (copied in, or left by a run of another config) is never taken for one of ours.
    """

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]):
        self.path = Path(path)
        self.dir = partial_path(self.path)
        self.fingerprint = fingerprint
        text = json.dumps(fingerprint, sort_keys=True, default=str)
        self.stamp = {RUN_KEY: hashlib.sha256(text.encode()).hexdigest().encode()}

    def manifest(self) -> dict[str, Any] | None:
        """What the partial run computes, or None when there is no partial run to continue."""
        if self.dir.is_symlink():
            raise DataError(
                "the partial folder is a symbolic link, not one gradscope made; remove it",
                str(self.dir),
            )
        self.refuse_foreign()
        try:
            manifest = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, ValueError):
            return None  # no run, or one killed before its first part: nothing to keep
        if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
            raise DataError(
                f"the partial run's {MANIFEST} is damaged; run without --resume to start over",
                str(self.dir),
            )
        return manifest

    def refuse_foreign(self) -> None:
        """Refuse what sits at the partial folder's name unless a run made it (a folder holding
        only a manifest, parts and their temporary files): a run never uses or removes a file it
        did not make, such as an earlier output given that name."""
        if self.dir.is_symlink() or not self.dir.exists():
            return  # a link planted there: the caller refuses it, or removes the link itself
        found = "a file"
        if self.dir.is_dir():
            names = (f.name for f in self.dir.iterdir() if not RUN_FILE.fullmatch(f.name))
            found = next((f"a folder holding {name!r}" for name in names), "")
        if found:
            raise DataError(
                f"{found} that no gradscope run made is at the partial folder's name; it is left "
                "as it is: move it or choose another --out",
                str(self.dir),
            )

    def start(self) -> None:
        """Begin afresh: an earlier run's partial state is removed (a link planted there, not
        what it points to)."""
        if self.dir.is_symlink():
            self.dir.unlink()
        self.refuse_foreign()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.mkdir()
        except OSError as e:
            raise DataError(f"cannot write the scores: {e.strerror or e}", str(self.dir)) from e
        text = json.dumps({"fingerprint": self.fingerprint}, default=str).encode()
        replace_atomically(self.dir / MANIFEST, lambda f: f.write(text))

    def _ours(self, part: Path, number: int) -> bool:
        """Whether a part's footer reads back (a 0-byte or truncated file does not) and carries
        this run's stamp and its own batch number."""
        try:
            meta = pq.read_metadata(part)
        except (OSError, pa.ArrowException):
            return False
        stamp = meta.metadata or {}
        mine = stamp.get(RUN_KEY) == self.stamp[RUN_KEY]
        return meta.num_rows > 0 and mine and stamp.get(PART_KEY) == str(number).encode()

    def saved(self) -> int:
        """How many complete parts of this run the folder holds (nothing removed)."""
        return sum(number is not None for _, number in self._found())

    def done(self) -> set[int]:
        """The batch numbers whose parts are complete and ours; any other part (a power loss
        before its data reached the disk, another run's) is removed, to be scored again."""
        numbers = set()
        for part, number in self._found():
            if number is None:
                part.unlink()
            else:
                numbers.add(number)
        return numbers

    def _found(self) -> Iterator[tuple[Path, int | None]]:
        """Each part file, with its batch number where it is complete and ours, else None."""
        for part in self.dir.glob("part-*.parquet"):
            number = part.name[5:-8]
            ours = number.isdigit() and self._ours(part, int(number))
            yield part, int(number) if ours else None

    def _part(self, number: int) -> Path:
        return self.dir / f"part-{number:09d}.parquet"

    def write(self, number: int, columns: dict[str, Any], data: str | None = None) -> None:
        """Batch ``number``'s rows as one complete part file, stamped as this run's (and with
        ``data``, the sha256 of the batch's rows); a column may be an Arrow array already."""
        table = pa.table(
            {name: v if isinstance(v, pa.Array) else _array(v) for name, v in columns.items()}
        )
        stamp = {**self.stamp, PART_KEY: str(number).encode()}
        table = table.replace_schema_metadata(stamp | ({DATA_KEY: data.encode()} if data else {}))
        replace_atomically(self._part(number), lambda f: pq.write_table(table, f))

    def data(self, number: int) -> str | None:
        """The sha256 of the rows part ``number`` was scored from, where the run stamped it."""
        stamp = pq.read_metadata(self._part(number)).metadata or {}
        return stamp[DATA_KEY].decode() if DATA_KEY in stamp else None

    def names(self) -> list[str]:
        """The columns of the parts."""
        return pq.read_schema(self._part(0)).names

    def column(self, name: str, parts: int) -> np.ndarray | None:
        """Column ``name`` of parts ``0 .. parts-1`` in order; None when the parts lack it."""
        if parts == 0 or name not in self.names():
            return None
        chunks = [pq.read_table(self._part(n), columns=[name]).column(0) for n in range(parts)]
        return np.concatenate([c.to_numpy() for c in chunks])

    def check_complete(self, parts: int) -> None:
        """Every part ``0 .. parts-1`` is there and ours."""
        missing = sorted(set(range(parts)) - self.done())
        if missing:
            raise DataError(
                f"the partial run lacks batch {missing[0]}; run again with --resume to score it",
                str(self.dir),
            )

    def assemble(
        self,
        parts: int,
        metadata: dict[str, Any],
        more: Callable[[], dict[str, np.ndarray]] = dict,
    ) -> Path:
        """Parts ``0 .. parts-1`` in order, one row group each, into ``path`` with ``metadata``
        under the ``gradscope`` key, and the columns ``more()`` computes from the whole parts
        (one value a row) before ``finite``; the folder goes. A column whose type differs between
        parts (whole-number targets in one CSV shard) takes the type that holds them all, and
        ids that are text in one part and numbers in another are all text."""
        self.check_complete(parts)
        schemas = [pq.read_schema(self._part(n)).remove_metadata() for n in range(parts)]
        try:
            first = _unified(schemas)
        except (pa.ArrowException, ValueError) as e:
            raise DataError(
                f"the batches' columns do not fit one table: {one_line(e)}", str(self.dir)
            ) from e
        names = first.names  # the parts' columns, in the first part's order
        extra = more()
        at = first.get_field_index("finite") if "finite" in names else len(first)
        for name in reversed(list(extra)):
            first = first.insert(at, pa.field(name, arrow_type(extra[name])))
        schema = first.with_metadata({METADATA_KEY: json.dumps(metadata, default=str)})

        def write(f: Any) -> None:
            start = 0
            with pq.ParquetWriter(f, schema) as writer:
                for number in range(parts):
                    table = pq.read_table(self._part(number)).select(names)
                    stop = start + len(table)
                    for name in reversed(list(extra)):
                        table = table.add_column(at, name, pa.array(extra[name][start:stop]))
                    writer.write_table(table.cast(schema))
                    start = stop

        try:
            replace_atomically(self.path, write)
        except (pa.ArrowException, KeyError) as e:  # a value or a column that does not fit
            raise DataError(
                f"the batches' columns do not fit one table: {one_line(e)}", str(self.dir)
            ) from e
        self.finish()
        return self.path

    def finish(self) -> None:
        """The output is whole: the partial folder is litter now, and goes."""
        shutil.rmtree(self.dir, ignore_errors=True)


def _array(values: Any) -> pa.Array:
    """A column as Arrow; one whose values mix text and numbers (the ids of a batch that spans
    two CSV shards, each read with its own types) as text."""
    kind = arrow_type(values)
    if kind == pa.string() and isinstance(values, np.ndarray) and values.dtype == object:
        values = values.astype(str)
    return pa.array(values, type=kind)


def _unified(schemas: list[pa.Schema]) -> pa.Schema:
    """The schema that holds every part's columns: numbers promoted as Arrow does, and a column
    that is text in any part made text in all."""
    text = {f.name for s in schemas for f in s if pa.types.is_string(f.type)}
    schemas = [pa.schema([f.with_type(pa.string()) if f.name in text else f for f in s])
               for s in schemas]  # fmt: skip
    return pa.unify_schemas(schemas, promote_options="permissive")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``gradscope`` metadata of a scores file."""
    try:
        raw = pq.read_schema(path).metadata
    except (OSError, pa.ArrowException) as e:  # not Parquet, cut short
        raise DataError(f"not a readable Parquet file: {one_line(e)}", str(path)) from e
    return parse_metadata(raw)


def parse_metadata(raw: dict[bytes, bytes] | None) -> dict[str, Any]:
    """The ``gradscope`` key of a schema's metadata; {} when there is none, or when another
    tool left it unreadable (not JSON, not an object): the scores are read without it then."""
    try:
        meta = json.loads((raw or {}).get(METADATA_KEY, b"{}"))
    except ValueError:  # not JSON, not UTF-8
        return {}
    return meta if isinstance(meta, dict) else {}


def nested(meta: dict[str, Any], *keys: str) -> Any:
    """``meta[k1][k2]...``, or None where a key is missing or a value on the way is not a
    mapping (metadata another tool edited)."""
    for key in keys:
        meta = meta.get(key) if isinstance(meta, dict) else None
    return meta
