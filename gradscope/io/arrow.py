"""Arrow data as Hugging Face `datasets` writes it (save_to_disk folders, .arrow files), via pyarrow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import DataError


def record_columns(record: pa.RecordBatch) -> dict[str, Any]:
    """A record batch's columns as numpy arrays (list columns: object arrays of row arrays)."""
    return {
        name: record.column(name).to_numpy(zero_copy_only=False) for name in record.schema.names
    }


def arrow_files(folder: Path) -> list[str]:
    """The .arrow files of a ``save_to_disk`` folder, in the dataset's row order."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"a DatasetDict folder; point data.path at one split's folder ({', '.join(splits)})",
            str(folder),
        )
    state = folder / "state.json"
    if state.is_file():
        files = [folder / name for name in _state_files(state)]
    else:
        files = sorted(folder.glob("*.arrow"))
    if not files:
        raise DataError(
            "the folder holds no .arrow files (a datasets save_to_disk folder?)", str(folder)
        )
    return [str(f) for f in files]


def _state_files(state: Path) -> list[str]:
    """The file names ``state.json`` lists: plain names inside its folder, nothing else."""
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:  # not JSON, or not datasets' layout
        raise DataError(
            f"state.json does not list the dataset's files: {type(e).__name__}: {e}", str(state)
        ) from e
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise DataError(
                f"state.json names {name!r}, not a file inside the dataset folder", str(state)
            )
    return names


def _records(path: str) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """The schema and record batches of an Arrow IPC file or stream (``datasets`` writes streams),
    memory-mapped: rows are read only when a batch's columns are converted."""
    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        stream = pa.ipc.open_stream(source)
        return stream.schema, iter(stream)


def arrow_source_parts(path: str) -> tuple[int, list[str], Any]:
    """(rows, read, column names) for one .arrow file; ``read(rows)`` yields runs of rows."""
    try:
        schema, records = _records(path)
        n_rows = sum(r.num_rows for r in records)  # headers only: the file is memory-mapped
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"cannot read Arrow file: {e}", path) from e

    def read(rows: int) -> Iterator[dict[str, Any]]:
        for record in _records(path)[1]:
            for lo in range(0, record.num_rows, rows):
                yield record_columns(record.slice(lo, rows))

    return n_rows, read, schema.names
