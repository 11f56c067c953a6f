"""Scores to Parquet: schema declared up front, one row group per batch, moved into place at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

METADATA_KEY = b"gradscope"


def partial_path(path: str | Path) -> Path:
    """Where a run writes until it completes; a file at ``path`` is always a finished run."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


class ScoreWriter:
    """Writes batches of scores as row groups to a temporary file, renamed over ``path`` on success.

    On an exception the partial file is left where it is, and ``path`` is not touched.
    """

    def __init__(self, path: str | Path, schema: pa.Schema, metadata: dict[str, Any]):
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        self.schema = schema.with_metadata({METADATA_KEY: json.dumps(metadata, default=str)})
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None

    def __enter__(self) -> ScoreWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(self.tmp, self.schema)
        return self

    def write(self, columns: dict[str, Any]) -> None:
        batch = pa.record_batch(
            [pa.array(columns[f.name], type=f.type) for f in self.schema], schema=self.schema
        )
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def __exit__(self, exc_type, exc, tb) -> None:
        self._writer.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``gradscope`` metadata of a scores file."""
    raw = pq.read_schema(path).metadata or {}
    return json.loads(raw[METADATA_KEY]) if METADATA_KEY in raw else {}
