"""Outlier tables: robust z, one- and two-sided ranking, per-class counts, non-finite rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from gradscope.errors import DataError
from gradscope.summary import BARS, SPARK_BINS, Spread, rank, sparkline, summarize, top_positions


def text(group) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(group)
    return console.export_text()


def test_spread_and_z():
    values = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    spread = Spread.of(values)
    assert (spread.median, spread.mad) == (3.0, 1.0)
    np.testing.assert_allclose(spread.z(values), (values - 3.0) / 1.4826)
    assert Spread.of(np.ones(4)).z(np.array([1.0, 3.0])).tolist() == [0.0, 2.0]  # MAD 0


def test_one_sided_for_nonnegative_scores_two_sided_for_signed():
    ok = np.ones(5, bool)
    norms = np.array([1.0, 0.0, 2.0, 9.0, 1.5])
    assert top_positions(norms, ok, Spread.of(norms), 2).tolist() == [3, 2]
    signed = np.array([0.1, -9.0, 0.2, 3.0, 0.0])
    assert top_positions(signed, ok, Spread.of(signed), 2).tolist() == [1, 3]
    ok[1] = False
    assert top_positions(signed, ok, Spread.of(signed[ok]), 1).tolist() == [3]


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
    out = text(summarize(tmp_path / "s.parquet", k=2))
    # the outlier table has no outer edge; the per-class table's rows start with one
    rows = [line.split("│") for line in out.splitlines() if "│" in line[1:] and line[0] != "│"]
    assert rows[0][0].strip() == "33" and rows[0][1].strip() == "3.3"
    assert rows[1][0].strip() == "7"
    assert "50 examples; grad_norm: median" in out and "1 non-finite" in out
    assert "per class (grad_norm)" in out
    with pytest.raises(DataError, match="no column 'cosine'"):
        summarize(tmp_path / "s.parquet", "cosine")


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
    out = text(summarize(tmp_path / "s.parquet", k=2))
    header = next(line for line in out.splitlines() if "example_id" in line).split()
    assert [h for h in header if h.isidentifier()] == [
        "example_id", "loss", "grad_norm", "self_influence", "target", "pred", "prob", "margin",
        "robust_z",
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
    ]  # z = 2.5 / (1.4826 * 1.5)
