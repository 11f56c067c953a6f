"""The command line in a batch job, read the next morning: a first and a last line, progress
lines, --by checked before the run, the file written announced, and tables that say in plain
text what colour says on a terminal and fit 80 columns without breaking a word."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from project import make_project
from rich.console import Console
from typer.testing import CliRunner

from gradscope import terminal
from gradscope.cli import app
from gradscope.config import load_config, with_overrides
from gradscope.run import score_dataset
from gradscope.scorers import InfluenceScorer, NormsScorer
from gradscope.summary import summarize

runner = CliRunner()  # its output is not a terminal, as a batch job's log is not


def lines(result) -> list[str]:
    return result.stdout.strip().splitlines()


def test_a_log_starts_with_the_command_and_ends_with_the_elapsed_time(tmp_path, monkeypatch):
    make_project(tmp_path)  # 23 rows, batches of 4
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(terminal, "LOG_EVERY", 0.0)  # a progress line after every batch
    result = runner.invoke(app, ["norms", "config.yaml", "--top-k", "3"])
    assert result.exit_code == 0, result.output
    out = lines(result)
    date = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}"
    assert re.fullmatch(rf"started {date}: gradscope norms config.yaml --top-k 3 \(in .+\)", out[0])
    assert out[0].endswith(f"(in {tmp_path})")
    assert re.fullmatch(rf"finished {date}, in \d+\.\d s", out[-1]), out[-1]
    progress = [line for line in out if line.startswith("norms: ")]
    rows = [4, 8, 12, 16, 20, 23]
    assert [int(re.match(r"norms: (\d+) of 23 rows", p)[1]) for p in progress] == rows
    shape = r"norms: \d+ of 23 rows \(\d+%\) in \d+\.\d s, [\d,]+ rows/s, about \d+\.\d s left"
    assert all(re.fullmatch(shape, p) for p in progress[:-1]), progress
    done = r"norms: 23 of 23 rows \(100%\) in \d+\.\d s, [\d,]+ rows/s"  # nothing left
    assert re.fullmatch(done, progress[-1]), progress[-1]
    assert out[-2] == "wrote scores.parquet"


def test_no_progress_line_before_its_interval(tmp_path):
    config = make_project(tmp_path)
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    assert not [line for line in lines(result) if line.startswith("norms: ")]  # 30 s not passed


def test_a_failed_run_logs_when_it_stopped_and_errs_in_one_line(tmp_path):
    config = make_project(tmp_path)
    result = runner.invoke(app, ["norms", str(config), "--batch-size", "0"])
    assert result.exit_code == 2
    out = lines(result)
    assert out[0].startswith("started ") and re.fullmatch(r"stopped .*, after \d+\.\d s", out[-1])
    assert result.stderr.strip().splitlines() == [
        "error: --batch-size must be at least 1, got 0 (--batch-size)"
    ]


def test_summary_writes_no_log_lines(tmp_path):
    config = make_project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    result = runner.invoke(app, ["summary", str(tmp_path / "scores.parquet")])
    assert result.exit_code == 0, result.output
    assert lines(result)[0].startswith("loss ") and "finished" not in result.stdout


def test_a_by_typo_fails_before_the_run(tmp_path):
    config = make_project(tmp_path)
    result = runner.invoke(app, ["norms", str(config), "--by", "gradnorm:high"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: no column 'gradnorm' to rank by; this run writes example_id, loss, grad_norm, "
        "target, pred, prob, margin, robust_z, class_z, finite (--by)"
    ]
    assert [p.name for p in tmp_path.iterdir() if "scores" in p.name] == []  # nothing ran
    ok = runner.invoke(app, ["norms", str(config), "--per-layer", "--by", "grad_norm/fc1:low"])
    assert ok.exit_code == 0, ok.output
    assert "top 20 outliers by grad_norm/fc1, lowest first" in ok.stdout


def scorer_variants(tmp_path):
    """(config, scorer) pairs covering every optional column."""
    config = make_project(tmp_path, data__ids="name")
    torch.save({"x": torch.randn(3, 5), "y": torch.tensor([0, 1, 2])}, tmp_path / "ref.pt")
    torch.save(torch.load(tmp_path / "net.pt"), tmp_path / "early.pt")
    checkpoints = [{"path": "early.pt", "weight": 0.5}, {"path": "net.pt", "weight": 1.0}]
    several = tmp_path / "several.yaml"
    several.write_text(
        config.read_text().replace("checkpoint: net.pt", f"checkpoints: {checkpoints}")
    )
    ref = tmp_path / "ref.pt"
    return [
        (with_overrides(load_config(config), per_layer=True, out=str(tmp_path / "a.parquet")),
         NormsScorer()),
        (with_overrides(load_config(several), out=str(tmp_path / "b.parquet")), NormsScorer()),
        (with_overrides(load_config(several), out=str(tmp_path / "c.parquet")),
         InfluenceScorer(ref, per_ref=True)),
        (with_overrides(load_config(config), out=str(tmp_path / "d.parquet")),
         InfluenceScorer(ref)),
    ]  # fmt: skip


def test_the_columns_a_run_writes_are_the_ones_it_said_it_may(tmp_path):
    for cfg, scorer in scorer_variants(tmp_path):
        said = scorer.names(cfg)
        written = pq.read_schema(score_dataset(cfg, scorer)).names
        modules = [n for n in written if n.startswith("grad_norm/")]
        assert [n for n in said if n != "grad_norm/<module>"] == [
            n for n in written if n not in modules
        ], (said, written)
        assert bool(modules) == ("grad_norm/<module>" in said)


def test_the_written_file_is_announced_when_its_tables_fail(tmp_path, monkeypatch):
    """The tables of a file written fail (a column found only in the file to hold no numbers,
    as string ids did before --by refused them early): the run's file is still announced."""
    from gradscope.cli import scoring
    from gradscope.errors import DataError

    def failing(*args, **kwargs):
        raise DataError("column 'x' holds string, not numbers to rank by", "--by")

    monkeypatch.setattr(scoring, "print_tables", failing)
    config = make_project(tmp_path)
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2, result.output
    assert "wrote scores.parquet" in result.stdout.replace(str(tmp_path) + "/", "")
    assert result.stderr.strip().splitlines() == [
        "error: column 'x' holds string, not numbers to rank by (--by)"
    ]
    assert len(pd.read_parquet(tmp_path / "scores.parquet")) == len(
        torch.load(tmp_path / "data.pt")["y"]
    )


def write_influence(path, n: int = 40) -> None:
    rng = np.random.default_rng(1)
    influence = rng.standard_normal(n)
    pq.write_table(pa.table({
        "example_id": np.arange(n), "loss": rng.random(n), "grad_norm": rng.random(n) * 10,
        "influence": influence, "cosine": influence / 10, "target": np.arange(n) % 3,
        "pred": np.arange(n) % 2, "prob": rng.random(n) / 1000, "margin": -rng.random(n),
        "finite": np.ones(n, bool),
    }), path)  # fmt: skip


def render(path, width: int, color: bool = False, by: str | None = None) -> str:
    console = Console(
        width=width,
        record=True,
        file=open("/dev/null", "w"),  # noqa: SIM115
        force_terminal=color,
        color_system="standard" if color else None,
    )
    console.print(summarize(path, by, 3))
    return console.export_text()


def test_plain_text_says_what_red_marks(tmp_path):
    write_influence(tmp_path / "i.parquet")
    plain = render(tmp_path / "i.parquet", 200).splitlines()
    assert "red" not in plain[0]
    marks = plain[1].split("  ^:")[0]
    assert plain[1].endswith("^: the bins holding the top 3 at each end")
    assert set(marks.strip()) == {"^", " "} or set(marks.strip()) == {"^"}
    start = plain[0].index(" ", len("influence ")) + 1  # where the bars begin
    assert marks[:start].strip() == ""
    bars = plain[0][start : start + 40]
    assert all(bars[i] != " " for i, c in enumerate(marks[start:]) if c == "^")  # under bars
    coloured = render(tmp_path / "i.parquet", 200, color=True).splitlines()
    assert coloured[0].endswith("red: top 3 at each end") and "^" not in coloured[1]
    result = runner.invoke(app, ["summary", str(tmp_path / "i.parquet"), "--top-k", "3"])
    assert lines(result)[1].endswith("^: the bins holding the top 3 at each end")


def test_a_signed_score_gives_its_min_and_max(tmp_path):
    write_influence(tmp_path / "i.parquet")
    values = pd.read_parquet(tmp_path / "i.parquet")["influence"]
    footer = render(tmp_path / "i.parquet", 200).strip().splitlines()[-1]
    assert f"min {values.min():.4g}, max {values.max():.4g};" in footer
    footer = render(tmp_path / "i.parquet", 200, by="grad_norm").strip().splitlines()[-1]
    assert "min" not in footer and "max" in footer  # never negative: max only


def header_names(block: list[str]) -> list[str]:
    """The column names of one table, its header lines joined column by column; a name broken
    over lines must break after a ``_``, not inside a word."""
    rows = [[c.strip() for c in line.split("┃")] for line in block if "┃" in line]
    names = []
    for parts in zip(*rows, strict=True):
        pieces = [p for p in parts if p]
        assert all(p.endswith("_") for p in pieces[:-1]), pieces
        names.append("".join(pieces))
    return names


@pytest.mark.parametrize("width", [80, 60])
def test_tables_at_80_columns_break_no_word(tmp_path, width):
    write_influence(tmp_path / "i.parquet")
    text = render(tmp_path / "i.parquet", width)
    assert max(map(len, text.splitlines())) <= width
    wide = render(tmp_path / "i.parquet", 1000)
    # each table: header lines, then a rule, then its rows
    blocks, current = [], []
    for line in text.splitlines():
        if "┃" in line:
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    names = [header_names(b) for b in blocks]
    expected = header_names([line for line in wide.splitlines() if "┃" in line][:1])
    outliers = [n for n in names if n[0] == "example_id"]
    assert len(outliers) >= 2  # two ends, each in one or more tables
    seen = [name for table in outliers for name in table[1:]]
    assert sorted(set(seen)) == sorted(expected[1:])  # every column once per end, none broken
    assert len(seen) == 2 * (len(expected) - 1)
    cells = [c.strip() for line in text.splitlines() if "│" in line for c in line.split("│")]
    wide_cells = {c.strip() for line in wide.splitlines() if "│" in line for c in line.split("│")}
    assert set(cells) <= wide_cells  # no number broken over two lines


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["influence", "{config}"], "error: missing option '--ref' (gradscope influence --help)"),
        (["norms"], "error: missing argument 'CONFIG' (gradscope norms --help)"),
        (["norms", "{config}", "--top-k", "x"], "error: invalid value for '--top-k'"),
        (["norms", "{config}", "--nope"], "error: no such option: --nope"),
        (["nonsense"], "error: no such command 'nonsense' (gradscope --help)"),
    ],
)
def test_a_bad_command_line_is_one_error_line_and_no_log(tmp_path, args, error):
    config = make_project(tmp_path)
    result = runner.invoke(app, [a.format(config=config) for a in args])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(error), line


def test_a_bad_option_under_python_m_points_to_gradscope_s_help(tmp_path):
    """Under `python -m gradscope` the hint read "(gradscope -m gradscope norms --help)"."""
    config = make_project(tmp_path)
    args = ["norms", str(config), "--batch-size", "x"]
    result = runner.invoke(app, args, prog_name="python -m gradscope")
    assert result.exit_code == 2 and result.stderr.strip().endswith("(gradscope norms --help)")


def test_help_starts_no_log(tmp_path):
    result = runner.invoke(app, ["influence", "--help"])
    assert result.exit_code == 0 and result.stdout.startswith("Usage: root influence")


def test_index_and_query_are_logged(tmp_path, monkeypatch):
    make_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    torch.save(torch.load("data.pt"), "ref.pt")
    query = ["query", "idx", "--ref", "ref.pt", "--config", "config.yaml"]
    for args in (["index", "config.yaml", "--out", "idx"], query):
        out = lines(runner.invoke(app, args))
        assert out[0].startswith("started ") and out[-1].startswith("finished "), out


def test_a_narrow_table_keeps_its_title_and_caption_on_one_line(tmp_path):
    path = tmp_path / "narrow.parquet"
    pq.write_table(pa.table({"example_id": np.arange(30), "score": np.linspace(-1, 1, 30)}), path)
    result = runner.invoke(app, ["summary", str(path), "--by", "score:high", "--top-k", "2"])
    out = lines(result)
    assert "top 2 outliers by score, highest first" in [line.strip() for line in out]
    assert "robust_z = (x - median) / (1.4826 MAD)" in [line.strip() for line in out]


def test_a_reader_that_goes_away_leaves_the_run_whole(tmp_path):
    """``gradscope norms --report | head -1``: the scores and the report are written, and the
    run ends as it would have, its other lines dropped, nothing on stderr."""
    import os
    import subprocess
    import sys

    config = make_project(tmp_path)
    command = [sys.executable, "-m", "gradscope", "norms", str(config), "--report"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""
    assert (tmp_path / "scores.parquet").is_file() and (tmp_path / "scores.html").is_file()
