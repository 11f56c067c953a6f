"""Outlier tables: robust z, one- and two-sided ranking, per-class counts, non-finite rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from gradscope.errors import ConfigError, DataError
from gradscope.io.scorefile import numbers
from gradscope.outliers import Spread, class_z, parse_by, rank, top_positions
from gradscope.summary import BARS, SPARK_BINS, sparkline, summarize


def text(group) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(group)
    return console.export_text()


def test_spread_and_z():
    values = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    spread = Spread.of(values)
    assert (spread.median, spread.mad) == (3.0, 1.0)
    np.testing.assert_allclose(spread.z(values), (values - 3.0) / 1.4826)
    assert Spread.of(np.ones(4)).z(np.array([1.0, 3.0])).tolist() == [0.0, 2.0]  # all equal
    mostly = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 7.0])  # MAD 0: the mean deviation's scale
    np.testing.assert_allclose(Spread.of(mostly).z(mostly), mostly / (1.2533 * 7.01 / 7))


def test_top_positions_at_either_end_and_the_ends_shown():
    ok = np.ones(5, bool)
    norms = np.array([1.0, 0.0, 2.0, 9.0, 1.5])
    assert top_positions(norms, ok, "high", 2).tolist() == [3, 2]
    assert top_positions(norms, ok, "low", 2).tolist() == [1, 0]
    signed = np.array([0.1, -9.0, 0.2, 3.0, 0.0])
    assert top_positions(signed, ok, "low", 2).tolist() == [1, 4]
    ok[1] = False
    assert top_positions(signed, ok, "low", 1).tolist() == [4]
    assert parse_by("influence:low") == ("influence", "low")
    assert parse_by("loss@0") == ("loss@0", None) and parse_by(None) == (None, None)
    with pytest.raises(ConfigError, match="--by takes COLUMN, COLUMN:low or COLUMN:high"):
        parse_by("loss:up")


def test_signed_scores_show_both_ends_and_checkpoints_rank_by_self_influence(tmp_path):
    n = 30
    influence = np.linspace(-1, 1, n)
    influence[[4, 9]] = [-50.0, 40.0]
    table = pa.table({"example_id": np.arange(n), "grad_norm": np.abs(influence),
                      "self_influence": np.arange(n, dtype=float), "influence": influence})  # fmt: skip
    pq.write_table(table, tmp_path / "i.parquet")
    found = rank(tmp_path / "i.parquet", k=3)
    assert [(e.direction, e.top[0]) for e in found.ends] == [("high", 9), ("low", 4)]
    out = text(summarize(tmp_path / "i.parquet", k=3))
    assert "top 3 outliers by influence, highest first (helpful)" in out
    assert "top 3 outliers by influence, lowest first (harmful)" in out
    assert [e.direction for e in rank(tmp_path / "i.parquet", "influence:low", 3).ends] == ["low"]
    pq.write_table(table.drop(["influence"]), tmp_path / "n.parquet")
    found = rank(tmp_path / "n.parquet", k=2)  # several checkpoints: self_influence
    assert found.score == "self_influence" and found.ends[0].top.tolist() == [29, 28]
    assert rank(tmp_path / "n.parquet", "grad_norm:low", 2).ends[0].top.tolist() == [14, 15]


def test_class_z_is_the_robust_z_within_the_target_class_and_classes_are_named(tmp_path):
    rng = np.random.default_rng(0)
    target = np.repeat([0, 1], 50)
    grad_norm = np.where(target == 0, 25.0, 0.25) * (1 + 0.1 * rng.standard_normal(100))
    grad_norm[70] = 0.5  # twice its class's median: global rank low, class_z high
    table = pa.table({"example_id": np.arange(100), "grad_norm": grad_norm, "target": target})
    pq.write_table(table, tmp_path / "s.parquet")
    z = class_z(grad_norm, np.ones(100, bool), target)
    for label in (0, 1):
        member = grad_norm[target == label]
        expected = (member - np.median(member)) / (
            1.4826 * np.median(np.abs(member - np.median(member)))
        )
        np.testing.assert_allclose(z[target == label], expected)
    found = rank(tmp_path / "s.parquet", "grad_norm", 3, classes=["cat", "dog"])
    assert 70 not in found.top and list(found.ends[0].rows)[-1] == "class_z"
    by_class = np.argsort(-z)[:1]
    assert by_class.tolist() == [70]
    out = text(summarize(tmp_path / "s.parquet", k=3, classes=["cat", "dog"]))
    assert "class_z" in out and " cat " in out and " dog " in out


def test_summarize_reads_rows_across_row_groups(tmp_path):
    n = 50
    grad_norm = np.linspace(0, 1, n)
    grad_norm[[7, 33]] = [10.0, 20.0]
    finite = np.ones(n, bool)
    grad_norm[40], finite[40] = np.nan, False
    table = pa.table({
        "example_id": np.arange(n), "loss": np.arange(n) / 10, "grad_norm": grad_norm,
        "target": np.arange(n) % 3, "finite": finite,
    })  # fmt: skip
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=8)
    out = text(summarize(tmp_path / "s.parquet", "grad_norm", k=2))
    # the outlier table has no outer edge; the per-class table's rows start with one
    rows = [line.split("│") for line in out.splitlines() if "│" in line[1:] and line[0] != "│"]
    assert rows[0][0].strip() == "33" and rows[0][1].strip() == "3.3"
    assert rows[1][0].strip() == "7"
    assert "50 examples; grad_norm: median" in out and "1 non-finite" in out
    assert "per class (grad_norm)" in out
    with pytest.raises(DataError, match="no column 'cosine'"):
        summarize(tmp_path / "s.parquet", "cosine")


@pytest.mark.parametrize("kind", [pa.bool_(), pa.int8()])
def test_a_missing_finite_flag_is_false_as_bools_or_integers(tmp_path, kind):
    """Another tool's 0/1 flags with one missing: read as floats, its NaN was true, and the
    row of loss 9 topped the table, in the median and the MAD."""
    flags = pa.array([1, 1, 1, 1, 1, None], pa.int8()).cast(kind)
    table = pa.table({
        "example_id": np.arange(6), "loss": [0.2, 0.3, 0.3, 0.4, 0.5, 9.0], "finite": flags,
    })  # fmt: skip
    pq.write_table(table, tmp_path / "s.parquet")
    out = " ".join(text(summarize(tmp_path / "s.parquet", "loss", k=3)).split())
    assert "median 0.3" in out and "max 0.5" in out and "1 non-finite" in out


def test_a_file_without_the_default_column_names_what_to_give(tmp_path):
    """Another tool's file with none of the columns: the error blamed --by, which nobody gave,
    then named grad_norm alone of those it looks for, and not the file. (A query's file, which
    needed --by score, ranks by its score.)"""
    pq.write_table(pa.table({"example_id": [0, 1], "other": [0.5, 0.2]}), tmp_path / "o.parquet")
    with pytest.raises(DataError, match="none of the default columns to rank by .influence, "
                       "self_influence, score, loss, grad_norm.*name one with --by") as raised:  # fmt: skip
        summarize(tmp_path / "o.parquet", None)
    assert raised.value.where == str(tmp_path / "o.parquet")
    pq.write_table(pa.table({"example_id": [0, 1], "score": [0.5, 0.2]}), tmp_path / "q.parquet")
    summarize(tmp_path / "q.parquet", None)


def test_sparkline_draws_the_histogram_and_marks_the_top_bins(tmp_path):
    values = np.concatenate([np.linspace(0.0, 1.0, 200), [20.0]])  # 41 bins of width 0.5
    table = pa.table({"example_id": np.arange(len(values)), "grad_norm": values})
    pq.write_table(table, tmp_path / "s.parquet")
    line = sparkline(rank(tmp_path / "s.parquet", k=1))
    counts, _ = np.histogram(values, bins=SPARK_BINS)
    bars = line.plain.split(" ", 2)[2][:SPARK_BINS]  # after "grad_norm 0 "
    assert [c != " " for c in bars] == [n > 0 for n in counts]
    levels = [BARS.index(c) for c, n in zip(bars, counts, strict=True) if n]
    heights = sorted(zip(counts[counts > 0], levels, strict=True))
    assert [h for _, h in heights] == sorted(levels) and levels[0] == len(BARS) - 1
    start = line.plain.index(bars)
    red = [(s.start, s.end) for s in line.spans if s.style == "red"]
    assert red == [(start + SPARK_BINS - 1, start + SPARK_BINS)]  # only the bin holding 20.0


def test_outlier_table_shows_the_prediction_columns(tmp_path):
    n = 6
    table = pa.table({
        "example_id": np.arange(n), "loss": np.ones(n), "grad_norm": np.arange(n, dtype=float),
        "self_influence": np.arange(n) ** 2.0, "target": np.zeros(n, np.int64),
        "pred": np.arange(n) % 2, "prob": np.full(n, 0.25), "margin": -np.arange(n, dtype=float),
        "finite": np.ones(n, bool),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "s.parquet")
    out = text(summarize(tmp_path / "s.parquet", "grad_norm", k=2))
    header = next(line for line in out.splitlines() if "example_id" in line).split()
    assert [h for h in header if h.isidentifier()] == [
        "example_id", "loss", "grad_norm", "self_influence", "target", "pred", "prob", "margin",
        "robust_z", "class_z",
    ]  # fmt: skip
    first = next(line for line in out.splitlines() if "│" in line).split("│")
    assert [c.strip() for c in first] == [
        "5",
        "1",
        "5",
        "25",
        "0",
        "1",
        "0.25",
        "-5",
        "1.124",
        "1.124",
    ]  # z = 2.5 / (1.4826 * 1.5); one class: class_z is robust_z


def test_columns_read_without_pandas_bools_at_any_offset():
    values = [True, False, True, True, False, False, True, False, True, True]
    for start in range(4):
        chunked = pa.chunked_array([pa.array(values).slice(start), pa.array([False, True])])
        assert numbers(chunked).tolist() == values[start:] + [False, True]
    assert numbers(pa.chunked_array([pa.array([1.5, None])])).tolist()[0] == 1.5  # nulls: to_numpy


@pytest.mark.parametrize(
    "kind", [pa.float64(), pa.float32(), pa.float16(), pa.int64(), pa.int8(), pa.uint32()]
)
def test_columns_read_numbers_at_any_offset_from_the_data_buffer(kind):
    # read off the buffer, not by Array.to_tensor, which pyarrows the project admits lack
    values = np.arange(12).astype(kind.to_pandas_dtype())
    for start in range(3):
        chunked = pa.chunked_array([pa.array(values, kind).slice(start, 7)])
        got = numbers(chunked)
        assert got.dtype == values.dtype and got.tolist() == values[start : start + 7].tolist()


def test_class_names_too_few_for_the_files_classes_are_named(tmp_path):
    """data.classes [a, b] over three classes showed 'a', 'b' and '2' side by side."""
    table = pa.table({"example_id": [0, 1, 2], "loss": [0.1, 0.2, 0.3], "target": [0, 1, 2],
                      "pred": [0, 1, 1]})  # fmt: skip
    pq.write_table(table, tmp_path / "s.parquet")
    with pytest.raises(
        DataError, match="data.classes names 2 classes; column target holds class 2"
    ):
        summarize(tmp_path / "s.parquet", None, classes=["a", "b"])
    summarize(tmp_path / "s.parquet", None, classes=["a", "b", "c"])
