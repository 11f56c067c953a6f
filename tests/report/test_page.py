"""The HTML report: the views a file's columns allow, the table, and the page in a real browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.errors import ConfigError, DataError
from gradscope.outliers import rank
from gradscope.report import charts, write_report
from gradscope.report.page import render

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def scores_file(path: Path, n: int = 40, **extra: np.ndarray) -> Path:
    rng = np.random.default_rng(0)
    grad_norm = rng.random(n)
    grad_norm[[5, 17]] = [9.0, 7.0]
    columns = {"example_id": np.arange(n), "loss": rng.random(n), "grad_norm": grad_norm,
               "target": np.arange(n) % 4, "finite": np.ones(n, bool), **extra}  # fmt: skip
    pq.write_table(pa.table(columns), path, row_group_size=16)
    return path


def captions(page: str) -> list[str]:
    return re.findall(r"<figcaption>(.*?)</figcaption>", page)


def body_rows(page: str) -> list[list[str]]:
    """Each table row's cells, as the data-sort values the page sorts by."""
    return [
        re.findall(r'<td[^>]*data-sort="([^"]*)"', row)
        for row in re.findall(r'<tr class="row">(.*?)</tr>', page, re.S)
    ]


def test_norms_file_histogram_classes_and_top_rows(tmp_path):
    page = render(scores_file(tmp_path / "s.parquet"), None, "grad_norm", 3)
    assert captions(page) == ["grad_norm: histogram, top 3 marked", "per class"]
    assert page.count("<svg") == 2 and not re.search(r'(src|href)="(https?:)?//', page)
    rows = body_rows(page)
    assert [r[0] for r in rows][:2] == ["5.0", "17.0"] and len(rows) == 3  # example_id first
    assert "--config" in page  # no config: the page says how to see the examples


def test_per_layer_and_influence_files_get_their_views(tmp_path):
    n = 40
    rng = np.random.default_rng(1)
    extra = {"grad_norm/fc1": rng.random(n), "grad_norm/fc2": rng.random(n),
             "influence": rng.normal(size=n), "cosine": rng.uniform(-1, 1, n)}  # fmt: skip
    page = render(scores_file(tmp_path / "s.parquet", n, **extra), None, "influence", 5)
    assert captions(page) == [
        "influence: histogram, top 5 at each end marked",
        "per class",
        "influence and cosine",
        "per module (--per-layer)",
    ]
    assert ">fc1<" in page and ">fc2<" in page  # the module names label the bars
    # influence unasked: both ends, helpful then harmful, each its own table
    titles = re.findall(r"<h2>(.*?)</h2>", page)
    assert titles == ["Top 5 by influence, highest first (helpful)",
                      "Top 5 by influence, lowest first (harmful)"]  # fmt: skip
    rows = body_rows(page)
    header = re.findall(r'<th data-column="([^"]+)"', page)[: len(rows[0])]
    at = header.index("influence")
    values = [float(r[at]) for r in rows]
    assert values[:5] == sorted(extra["influence"], reverse=True)[:5]
    assert values[5:] == sorted(extra["influence"])[:5]
    page = render(tmp_path / "s.parquet", None, "influence:low", 5)
    assert re.findall(r"<h2>(.*?)</h2>", page) == ["Top 5 by influence, lowest first (harmful)"]


def test_report_refuses_to_overwrite_its_inputs_and_a_missing_file(tmp_path):
    scores = scores_file(tmp_path / "s.parquet")
    with pytest.raises(ConfigError, match="the output path is the run's scores file"):
        write_report(scores, scores)
    with pytest.raises(DataError, match="scores file not found"):
        write_report(tmp_path / "none.parquet")
    assert write_report(scores) == tmp_path / "s.html"
    with pytest.raises(ConfigError, match="the output's folder .*missing does not exist"):
        write_report(scores, tmp_path / "missing" / "r.html")
    with pytest.raises(ConfigError, match="the output path is a folder"):
        write_report(scores, tmp_path)


def test_report_with_config_refuses_a_file_without_example_id(tmp_path):
    """Another tool dropped the column: the report cannot show which examples these are."""
    from project import make_project

    config = make_project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    table = pq.read_table(tmp_path / "scores.parquet")
    pq.write_table(table.drop_columns(["example_id"]), tmp_path / "noid.parquet")
    result = runner.invoke(app, ["report", str(tmp_path / "noid.parquet"), "--config", str(config)])
    assert result.exit_code == 2 and "has no example_id column" in result.stderr
    assert not (tmp_path / "noid.html").exists()


@pytest.mark.parametrize("ids", [["a", "b", "c"], [0.0, float("nan"), 2.0]], ids=["text", "nan"])
def test_an_example_id_that_is_no_row_number_is_one_line(tmp_path, ids):
    """Another tool wrote the ids as text, or with a NaN: the report named no row (it raised)."""
    from project import make_project

    config = make_project(tmp_path, n=3)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    table = pq.read_table(tmp_path / "scores.parquet")
    table = table.set_column(table.column_names.index("example_id"), "example_id", [ids])
    pq.write_table(table, tmp_path / "odd.parquet")
    result = runner.invoke(app, ["report", str(tmp_path / "odd.parquet")])
    assert result.exit_code == 2 and "example_id holds" in result.stderr, result.output
    assert "not a row number" in result.stderr


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing; .ci/run installs it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def dump_dom(page: Path, fragment: str, profile: Path) -> str:
    """The page's DOM after its scripts ran, from headless Chromium, offline."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}", "--dump-dom"]  # fmt: skip
    done = subprocess.run(
        [_chromium(), *flags, page.as_uri() + fragment],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_digits_report_in_a_real_browser(tmp_path):
    chromium = _chromium()  # skip before scoring when there is no browser
    assert chromium
    scores = tmp_path / "scores.parquet"
    args = ["norms", str(ROOT / "configs/digits.yaml"), "--out", str(scores), "--report"]
    result = runner.invoke(app, [*args, "--limit", "500", "--top-k", "12"])
    assert result.exit_code == 0, result.output
    dom = dump_dom(tmp_path / "scores.html", "#sort=-loss", tmp_path / "profile")
    (html,) = re.findall(r"<html[^>]*>", dom)
    assert 'data-report="ready"' in html and "data-report-error" not in html, html
    rows = re.findall(r'<tr class="row">(.*?)</tr>', dom, re.S)
    assert len(rows) == 12
    assert all(len(re.findall(r'<img src="data:image/png;base64,', row)) == 1 for row in rows)
    header = re.findall(r'<th data-column="([^"]+)"', dom)
    losses = [float(r[header.index("loss")]) for r in body_rows(dom)]
    assert losses == sorted(losses, reverse=True)  # the page's script sorted by #sort=-loss
    assert 'aria-sort="descending"' in dom


def test_box_plots_draw_the_outliers_and_classes_by_name(tmp_path):
    found = rank(scores_file(tmp_path / "s.parquet"), None, 3, ["a", "b", "c", "d"])
    svg = charts.classes(found)
    assert svg.count("<use ") >= 2  # the fliers 9.0 and 7.0 (rows 5 and 17, class 1)
    assert all(f">{name}<" in svg for name in "abcd")  # ticks as text (svg.fonttype none)


def test_a_box_plot_of_many_rows_draws_its_outliers_as_one_raster(tmp_path):
    """30k rows of a heavy tail: 0.46 MB of vector markers before; the box plot's outliers
    are one image now, and a small file's stay markers (the test above)."""
    n = 30_000
    tail = np.abs(np.random.default_rng(0).standard_cauchy(n))
    found = rank(scores_file(tmp_path / "s.parquet", n=n, grad_norm=tail), "grad_norm", 3, None)
    svg = charts.classes(found)
    assert svg.count("<image") == 4 and len(svg) < 60_000, len(svg)  # one for each class


def test_two_reports_of_one_file_are_the_same_page(tmp_path):
    """matplotlib salts a clip path's id at random unless told otherwise."""
    scores = scores_file(tmp_path / "s.parquet")
    pages = [write_report(scores, tmp_path / f"{k}.html").read_bytes() for k in range(2)]
    assert pages[0] == pages[1] and b"clipPath" in pages[0]


def test_one_top_row_is_a_row(tmp_path):
    svg = charts.histogram(rank(scores_file(tmp_path / "s.parquet"), "grad_norm", 1, None))
    assert ">top 1 row<" in svg


def test_histogram_counts_are_plain_text_on_the_log_axis(tmp_path):
    found = rank(scores_file(tmp_path / "s.parquet", n=400), None, 3, None)
    ticks = re.findall(r">([^<>]+)</text>", charts.histogram(found))
    assert "1" in ticks and "10" in ticks, ticks
    assert not [t for t in ticks if "$" in t or "\\" in t], ticks  # no TeX left as text


def test_scores_spanning_more_than_the_largest_float(tmp_path):
    """-1.7e308 to 1.7e308: numpy's bins overflowed, summary and report ended in a traceback."""
    loss = np.concatenate([[-1.7e308, 1.7e308], np.linspace(0, 1, 8)])
    pq.write_table(pa.table({"example_id": np.arange(10), "loss": loss,
                             "grad_norm": np.linspace(1, 2, 10)}), tmp_path / "s.parquet")  # fmt: skip
    result = CliRunner().invoke(app, ["summary", str(tmp_path / "s.parquet"), "--by", "loss"])
    assert result.exit_code == 0 and "max 1.7e+308" in result.output, result.output
    with pytest.raises(DataError, match="loss values span more than the largest float"):
        write_report(tmp_path / "s.parquet", by="loss")
    write_report(tmp_path / "s.parquet", by="grad_norm")


def test_cells_of_infinity_and_nan_sort_in_a_real_browser(tmp_path):
    """'inf' read back as NaN, so a column holding infinities sorted as text: -6.3 ... -inf,
    inf; a missing value shown 'None' sorted among them."""
    _chromium()
    margin = [-6.3, -np.inf, np.inf, np.nan, 1.0, None, 2.0, -1.0]
    table = pa.table({"example_id": np.arange(8), "loss": np.linspace(1, 2, 8),
                      "margin": pa.array(margin, pa.float64())})  # fmt: skip
    pq.write_table(table, tmp_path / "s.parquet")
    write_report(tmp_path / "s.parquet", top_k=8)
    for fragment, expected in (("#sort=margin", [-np.inf, -6.3, -1.0, 1.0, 2.0, np.inf]),
                               ("#sort=-margin", [np.inf, 2.0, 1.0, -1.0, -6.3, -np.inf])):  # fmt: skip
        dom = dump_dom(tmp_path / "s.html", fragment, tmp_path / "profile")
        header = re.findall(r'<th data-column="([^"]+)"', dom)
        cells = [r[header.index("margin")] for r in body_rows(dom)]
        numbers = [float(c) for c in cells[:6]]
        assert numbers == expected and len(cells) == 8, cells  # the two missing ones last
