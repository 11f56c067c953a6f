"""A scores file read as the summary, the report and the outliers read it: a column as a numpy
array off Arrow's buffers (no pandas), and a few rows by their positions, row group by row
group."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

Columns = dict[str, np.ndarray]  # a few rows of a scores file, column by column


def numbers(values: pa.ChunkedArray) -> np.ndarray:
    """Numbers or bools without nulls read off Arrow's data buffer, which, unlike ``to_numpy``,
    does not import pandas (half the start-up of ``gradscope summary``) and, unlike
    ``Array.to_tensor`` (new in recent pyarrows), every pyarrow from 14 on reads; anything else
    as ``to_numpy``."""
    array = values.combine_chunks()
    kind, data = array.type, array.buffers()[1] if len(array.buffers()) > 1 else None
    if array.null_count or data is None:
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_boolean(kind):  # bits, least significant first
        bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        return bits[array.offset : array.offset + len(array)].astype(bool)
    if pa.types.is_floating(kind) or pa.types.is_integer(kind):
        code = (
            "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
        )
        dtype = np.dtype(f"{code}{kind.bit_width // 8}")
        return np.frombuffer(data, dtype, len(array), array.offset * dtype.itemsize)
    return array.to_numpy(zero_copy_only=False)


def column(file: pq.ParquetFile, name: str) -> np.ndarray:
    """One column as a numpy array, read row group by row group."""
    parts = [numbers(file.read_row_group(i, columns=[name]).column(0))
             for i in range(file.num_row_groups)]  # fmt: skip
    return np.concatenate(parts) if parts else np.empty(0)


def rows_at(file: pq.ParquetFile, positions: np.ndarray, columns: list[str]) -> Columns:
    """The rows at ``positions`` (in that order), reading only the row groups that hold them."""
    found, start = {}, 0
    for i in range(file.num_row_groups):
        stop = start + file.metadata.row_group(i).num_rows
        inside = positions[(positions >= start) & (positions < stop)]
        if len(inside):
            group = file.read_row_group(i, columns=columns)
            for p in inside.tolist():
                found[p] = group.slice(p - start, 1).to_pylist()[0]
        start = stop
    return {name: np.asarray([found[p][name] for p in positions.tolist()]) for name in columns}
