"""The report of a watch file: the data map's numbers against a loop over the examples."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gradscope.errors import ConfigError
from gradscope.report import write_report
from gradscope.report.datamap import data_map, stays_high


def _watch_file(path, rows):
    table = pa.table({k: np.array([r[k] for r in rows]) for k in rows[0]})
    table = table.replace_schema_metadata({b"gradscope": json.dumps({"command": "watch"})})
    pq.write_table(table, path)


def test_data_map_is_each_examples_epochs_reduced(tmp_path):
    rng = np.random.default_rng(0)
    rows = [
        {"step": s, "epoch": e, "example_id": i, "grad_norm": rng.random(), "prob": rng.random(),
         "correct": float(rng.random() > 0.5)}
        for e in range(3) for s, i in enumerate([4, 2, 9, 2] if e == 1 else [4, 2, 9])
    ]  # fmt: skip  # example 2 seen twice in epoch 1: its epoch's mean counts once
    _watch_file(tmp_path / "w.parquet", rows)
    found = data_map(tmp_path / "w.parquet")
    assert found.ids.tolist() == [2, 4, 9] and found.epochs == 3
    for k, i in enumerate([2, 4, 9]):
        per_epoch = [
            np.mean([r["prob"] for r in rows if r["example_id"] == i and r["epoch"] == e])
            for e in range(3)
        ]
        assert np.isclose(found.confidence[k], np.mean(per_epoch))
        assert np.isclose(found.variability[k], np.std(per_epoch))
    norms = {i: [np.mean([r["grad_norm"] for r in rows if r["example_id"] == i and
                          r["epoch"] == e]) for e in range(3)] for i in (2, 4, 9)}  # fmt: skip
    lowest = {i: min(50.0 * sorted(v[e] for v in norms.values()).index(norms[i][e])
                     for e in range(3)) for i in norms}  # fmt: skip
    assert dict(zip(found.ids.tolist(), found.lowest_rank.tolist(), strict=True)) == lowest
    top = stays_high(found, 1)[0]
    assert int(top["example_id"]) == max(lowest, key=lowest.get)


def test_tied_norms_share_a_percentile_and_rows_of_no_target_rank_nowhere(tmp_path):
    """Six examples alike at every epoch took 0, 20, ... 100 by their order; a row of no
    counted target (finite false, grad_norm 0) sat in each epoch's pool."""
    rows = [{"step": e, "epoch": e, "example_id": i, "grad_norm": 1.0 if i < 6 else 2.0 + i,
             "prob": 0.5, "finite": i != 9}
            for e in range(2) for i in range(10)]  # fmt: skip
    _watch_file(tmp_path / "w.parquet", rows)
    found = data_map(tmp_path / "w.parquet")
    ranks = dict(zip(found.ids.tolist(), found.lowest_rank.tolist(), strict=True))
    assert [ranks[i] for i in range(6)] == [100 * 2.5 / 8] * 6  # ranks 0..5 of 9 averaged
    assert ranks[6] == 100 * 6 / 8 and ranks[8] == 100.0 and np.isnan(ranks[9])


def test_report_of_a_watch_file_draws_the_data_map(tmp_path):
    rows = [{"step": e, "epoch": e, "example_id": i, "grad_norm": 1.0 + i, "prob": 0.2 * i}
            for e in range(2) for i in range(4)]  # fmt: skip
    _watch_file(tmp_path / "w.parquet", rows)
    page = write_report(tmp_path / "w.parquet").read_text()
    assert "Data map" in page and "<svg" in page
    assert page.index("<td>3</td>") < page.index("<td>2</td>")  # the largest norm first


def test_report_of_a_regression_watch_file_lists_the_norms_without_a_map(tmp_path):
    """A watch file of mse (no prob) was refused whole ('lacks prob: no data map'), though its
    gradient norms make the table the guide promises."""
    rows = [{"step": 0, "epoch": 0, "example_id": i, "grad_norm": 1.0 + i} for i in range(4)]
    _watch_file(tmp_path / "w.parquet", rows)
    page = write_report(tmp_path / "w.parquet").read_text()
    assert "No data map" in page and "<svg" not in page and "<th>confidence</th>" not in page
    assert page.index("<td>3</td>") < page.index("<td>2</td>") and "over 1 epoch ·" in page


def test_an_example_seen_in_fewer_than_half_the_epochs_is_not_ranked(tmp_path):
    """Example 9, seen in epoch 0 alone with the largest norm, led the table at percentile 100
    (the lowest over the epochs it was in); example 8, left out of the last (partial) epoch,
    is ranked over the two that saw it."""
    rows = [{"step": e, "epoch": e, "example_id": i, "grad_norm": 1.0 + i, "prob": 0.5}
            for e in range(3) for i in range(4)]  # fmt: skip
    rows.append({"step": 0, "epoch": 0, "example_id": 9, "grad_norm": 1e3, "prob": 0.5})
    rows += [{"step": e, "epoch": e, "example_id": 8, "grad_norm": 1e2, "prob": 0.5}
             for e in range(2)]  # fmt: skip
    _watch_file(tmp_path / "w.parquet", rows)
    found = data_map(tmp_path / "w.parquet")
    assert np.isnan(found.lowest_rank[found.ids.tolist().index(9)])
    assert [r["example_id"] for r in stays_high(found, 2)] == ["8", "3"]
    page = write_report(tmp_path / "w.parquet").read_text()
    assert "1 example not ranked: fewer than half the epochs" in " ".join(page.split())


def test_a_watch_page_refuses_the_options_it_reads_nothing_of(tmp_path):
    rows = [{"step": e, "epoch": e, "example_id": i, "grad_norm": 1.0 + i, "prob": 0.5}
            for e in range(2) for i in range(3)]  # fmt: skip
    _watch_file(tmp_path / "w.parquet", rows)
    with pytest.raises(ConfigError, match="reads no --by"):
        write_report(tmp_path / "w.parquet", by="nonexistent:low")
    assert not (tmp_path / "w.html").exists()
