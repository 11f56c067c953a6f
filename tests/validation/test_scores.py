"""Score files read as (references, examples) matrices, and refused when they do not fit."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradscope.errors import DataError
from gradscope.validation import read_scores

ROWS, REFS = 5, 3


def write(path, columns, meta=None):
    table = pa.table(columns)
    if meta is not None:
        table = table.replace_schema_metadata({b"gradscope": json.dumps(meta)})
    pq.write_table(table, path)
    return path


def per_ref(path, shuffle=True, **meta):
    """Rows (example, ref) in a shuffled order; influence = 10 * example + ref."""
    example, ref = np.repeat(np.arange(ROWS), REFS), np.tile(np.arange(REFS), ROWS)
    order = np.random.default_rng(0).permutation(len(example)) if shuffle else slice(None)
    columns = {
        "example_id": example[order],
        "ref_id": ref[order],
        "influence": (10.0 * example + ref)[order],
        "loss": (1.0 * example)[order],
    }
    return write(path, columns, {"data_sha256": "d", "influence": {"ref_sha256": "r"}} | meta)


def test_per_ref_matrix(tmp_path):
    file = read_scores(
        per_ref(tmp_path / "s.parquet"), ["influence", "loss", "x"], ROWS, REFS, "r", "d"
    )
    assert file.per_ref and file.refs == REFS and set(file.columns) == {"influence", "loss"}
    expected = 10.0 * np.arange(ROWS)[None] + np.arange(REFS)[:, None]  # (R, N)
    np.testing.assert_array_equal(file.columns["influence"], expected)
    # suspicion: influence low-first, averaged over the references; loss high-first
    np.testing.assert_array_equal(file.suspicion("influence"), -expected.mean(0))
    np.testing.assert_array_equal(file.suspicion("loss"), np.arange(ROWS))
    assert file.seconds is None


def test_mean_file(tmp_path):
    path = write(tmp_path / "m.parquet", {"example_id": np.arange(ROWS)[::-1].copy(),
                                          "influence": np.arange(ROWS)[::-1] * 1.0},
                 {"seconds": 2.5})  # fmt: skip
    file = read_scores(path, ["influence"], ROWS, REFS, "r", "d")
    assert not file.per_ref and file.refs == 1 and file.seconds == 2.5
    np.testing.assert_array_equal(file.columns["influence"], [np.arange(ROWS)])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: per_ref(p, influence={"ref_sha256": "other"}), "against another REF"),
        (lambda p: per_ref(p, data_sha256="other"), "on other data"),
        (lambda p: write(p, {"example_id": np.arange(ROWS - 1), "influence": np.ones(ROWS - 1)}),
         "are not the 5 training rows"),
        (lambda p: write(p, {"example_id": np.arange(ROWS), "influence": [1, np.nan, 0, 0, 0]}),
         "NaN or infinite"),
        (lambda p: write(p, {"example_id": np.repeat(np.arange(ROWS), 2),
                             "ref_id": np.tile([0, 1], ROWS), "influence": np.ones(2 * ROWS)}),
         "each of the 3 references"),
        (lambda p: write(p, {"influence": np.ones(ROWS)}), "no example_id column"),
        (lambda p: write(p, {"example_id": np.arange(ROWS) * 1.0, "influence": np.arange(ROWS)}),
         "example_id column holds float64, not integers"),
        (lambda p: write(p, {"example_id": np.zeros(0, np.int64), "influence": np.zeros(0)}),
         r"\(0 of them\) are not the 5 training rows"),
        (lambda p: write(p, {"example_id": np.arange(ROWS), "influence": [[1.0, 2.0]] * ROWS}),
         "'influence' is not one number per row"),
        # rounding alone would rank the subsets' sums of a constant (an LDS of 0.7 was read)
        (lambda p: write(p, {"example_id": np.arange(ROWS), "influence": np.full(ROWS, 0.3)}),
         "'influence' is the same for every row: it ranks nothing"),
        (lambda p: write(p, {"example_id": np.repeat(np.arange(ROWS), REFS),
                             "ref_id": np.tile(np.arange(REFS), ROWS),
                             "influence": np.tile([0.0, 1.0, 2.0], ROWS)}),
         "the same for every row against reference 0"),
    ],
)  # fmt: skip
def test_refused(tmp_path, change, message):
    path = change(tmp_path / "s.parquet") or tmp_path / "s.parquet"
    with pytest.raises(DataError, match=message):
        read_scores(path, ["influence"], ROWS, REFS, "r", "d")


def test_the_key_columns_are_not_score_columns(tmp_path):
    """``--column example_id`` reads no second copy of the key (a KeyError was raised)."""
    file = read_scores(per_ref(tmp_path / "s.parquet"), ["example_id", "influence"], ROWS, REFS,
                       "r", "d")  # fmt: skip
    assert set(file.columns) == {"influence"}
