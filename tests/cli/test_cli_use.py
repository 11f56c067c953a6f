"""The command line as people use it: piped output whole, ranking by --by, version, help, noise."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from project import edit_config, make_project, slow_project
from rich.console import Console
from typer.testing import CliRunner

from gradscope import terminal as terminal_module
from gradscope.cli import app
from gradscope.config import load_config
from gradscope.io.parquet import read_metadata
from gradscope.resume import fingerprint
from gradscope.tables import fmt

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

LONG_PY = """
from torch import nn

from model import Net


class LongNames(Net):
    def __init__(self):
        super().__init__()
        self.encoder_projection_with_a_rather_long_descriptive_name = self.fc1
        del self.fc1

    def forward(self, x):
        hidden = self.encoder_projection_with_a_rather_long_descriptive_name(x).tanh()
        return self.fc2(hidden)
"""


def gradscope(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m gradscope ARGS`` with stdout a pipe, as in CI, ``| tee`` or ``> log``."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gradscope", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_piped_output_keeps_every_number_and_name_whole(tmp_path):
    (tmp_path / "long.py").write_text(LONG_PY)
    config = make_project(
        tmp_path, n=30, model__factory="long.py:LongNames", model__checkpoint=None
    )
    torch.save({"x": torch.randn(3, 5), "y": torch.tensor([0, 1, 2])}, tmp_path / "ref.pt")
    done = gradscope(
        "influence", config, "--ref", "ref.pt", "--per-ref", "--top-k", "5", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not out.startswith("\n") and "…" not in out  # no blank first line, nothing cut
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    header = [h.strip() for h in next(ln for ln in out.splitlines() if "┃" in ln).split("┃")]
    for name in ("example_id", "ref_id", "influence", "cosine", "prob", "margin", "class_z"):
        assert name in header
    lines = [line.split("│") for line in out.splitlines() if "│" in line and "┃" not in line]
    cells = [[c.strip() for c in line] for line in lines]
    for end, ascending in ((cells[:5], False), (cells[5:10], True)):
        expected = frame.sort_values("influence", ascending=ascending, kind="stable").head(5)
        at = header.index("influence")
        assert [row[at] for row in end] == [fmt(v) for v in expected["influence"]]
        assert [row[header.index("cosine")] for row in end] == [fmt(v) for v in expected["cosine"]]
    assert "wrote scores.parquet" in out  # the path as given, relative to the working folder
    done = gradscope("check", config, "--examples", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    name = "encoder_projection_with_a_rather_long_descriptive_name"
    assert any(f"{name}.weight" in line for line in done.stdout.splitlines())


def test_version_help_and_flags():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == "gradscope 0.1.0"
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.output and "--version" in result.output
    result = runner.invoke(app, ["norms", "--help"])
    assert result.exit_code == 0 and "<bool>" not in result.output
    assert "--per-layer " in result.output and "--by COLUMN[:low|high]" in result.output


def test_by_on_norms_influence_summary_and_report(tmp_path):
    config = make_project(tmp_path, n=23)
    result = runner.invoke(app, ["norms", str(config), "--by", "margin:low", "--top-k", "3"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert "top 3 outliers by margin, lowest first" in result.output
    first = next(line for line in result.output.splitlines() if "│" in line).split("│")
    assert first[0].strip() == str(frame["margin"].idxmin())
    scores = str(tmp_path / "scores.parquet")
    result = runner.invoke(app, ["summary", scores, "--by", "margin"])  # signed: both ends
    assert "margin, highest first" in result.output and "margin, lowest first" in result.output
    result = runner.invoke(app, ["summary", scores, "--by", "loss:sideways"])
    assert result.exit_code == 2
    assert (
        "error: --by takes COLUMN, COLUMN:low or COLUMN:high, got 'loss:sideways'" in result.stderr
    )
    result = runner.invoke(app, ["norms", str(config), "--by", "loss:up"])
    assert result.exit_code == 2 and "--by takes" in result.stderr  # before the run, not after
    out = tmp_path / "r.html"
    result = runner.invoke(app, ["report", scores, "--by", "loss:low", "--out", str(out)])
    assert result.exit_code == 0 and "by loss, lowest first" in out.read_text()


def test_classes_are_named_and_summary_and_report_take_the_configs_top_k(tmp_path):
    config = make_project(tmp_path, n=23, data__classes=["cat", "dog", "emu"], summary={"top_k": 4})
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("per class") :]
    assert all(f" {name} " in table for name in ("cat", "dog", "emu"))
    scores = str(tmp_path / "scores.parquet")
    shown = runner.invoke(app, ["summary", scores]).output  # from the file's metadata
    assert " emu " in shown and "top 4 outliers" in shown
    result = runner.invoke(app, ["report", scores, "--config", str(config)])
    page = (tmp_path / "scores.html").read_text()
    assert result.exit_code == 0 and page.count('<tr class="row">') == 4
    assert any(f">{name}<" in page for name in ("cat", "dog", "emu"))


def test_classes_too_few_and_by_a_column_of_no_scores_are_refused_before_the_run(tmp_path):
    """`data.classes` naming fewer classes than the targets hold, and `--by finite` or `--by
    id`, were refused after the run had written its file (and, with --report, no page); the
    classes are checked on each batch as it is scored, the columns before the run. The names
    are not the run's key: a run resumes under names mended."""
    config = make_project(tmp_path, n=23, data__classes=["cat", "dog"])
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2 and "data.classes names 2 classes" in result.stderr
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*partial"))
    for by in ("finite", "id"):
        result = runner.invoke(app, ["norms", str(config), "--by", by])
        assert result.exit_code == 2 and f"column '{by}' holds " in result.stderr
        assert "wrote" not in result.output and not list(tmp_path.glob("*.parquet"))
    key = fingerprint(load_config(config), "norms", [], None)
    edit_config(tmp_path, lambda c: c["data"].update(classes=["cat", "dog", "emu"]))
    assert fingerprint(load_config(config), "norms", [], None) == key


TOKENS_PY = """
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(11, 4), nn.Linear(4, 11)

    def forward(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids) * attention_mask[..., None])
"""


def test_every_ragged_column_in_one_error_and_the_pad_defaults(tmp_path):
    (tmp_path / "tiny.py").write_text(TOKENS_PY)
    rows = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    ids = pa.array(rows, pa.list_(pa.int64()))
    mask = pa.array([[1] * len(r) for r in rows], pa.list_(pa.int64()))
    columns = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    pq.write_table(pa.table(columns), tmp_path / "tokens.parquet")
    config = make_project(
        tmp_path,
        model={"factory": "tiny.py:Tiny"},
        data={"path": "tokens.parquet", "targets": "labels",
              "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"}},
        loss={"name": "cross_entropy"},
    )  # fmt: skip
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: columns 'input_ids' and 'labels' hold lists of different lengths; set "
        "data.pad.input_ids and data.pad.labels to pad them per batch"
    )  # attention_mask pads with 0 unless told otherwise
    edit_config(tmp_path, lambda raw: raw["loss"].update(name="causal_lm"))
    result = runner.invoke(app, ["norms", str(config)])
    assert "error: column 'input_ids' holds lists" in result.stderr  # labels: -100
    edit_config(tmp_path, lambda raw: raw["data"].update(pad={"input_ids": 0}))
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    pad = read_metadata(tmp_path / "scores.parquet")["config"]["data"]["pad"]
    assert pad == {"input_ids": 0, "attention_mask": 0, "labels": -100}
    result = runner.invoke(app, ["check", str(config), "--examples", "3"])
    assert (
        "padding: input_ids 0, attention_mask 0 (default), labels -100 (default)" in result.output
    )


def test_progress_bar_knows_its_total_and_rate(tmp_path, monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(terminal_module, "console", terminal)
    config = slow_project(tmp_path, n=12)
    monkeypatch.setenv("SLOW", "0.1")
    result = runner.invoke(app, ["norms", str(config), "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    drawn = terminal.file.getvalue()
    assert "12/12" in drawn and "rows/s" in drawn and "ETA" in drawn
    assert "/?" not in drawn  # hidden until the row count is known


WARNS_PY = """
import warnings

from model import Net


class Warns(Net):
    def forward(self, x):
        warnings.warn("a library's advice", UserWarning)
        raise RuntimeError("broken forward")
"""


@pytest.mark.slow
def test_quiet_only_our_lines_on_stderr(tmp_path):
    (tmp_path / "warns.py").write_text(WARNS_PY)
    config = make_project(tmp_path, model__factory="warns.py:Warns")
    done = gradscope("norms", config, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")  # no UserWarning
    assert "broken forward" in done.stderr
    pytest.importorskip("transformers")
    done = gradscope("check", ROOT / "configs/lm.yaml", "--examples", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "Loading weights" not in done.stdout  # transformers is quiet


def test_help_version_and_summary_import_neither_torch_nor_pandas(tmp_path):
    """What makes them start in under a second (timed by benchmarks/startup.py, not here)."""
    pq.write_table(
        pa.table({"example_id": [0, 1], "grad_norm": [1.0, 2.0]}), tmp_path / "s.parquet"
    )
    code = (
        "import sys\nfrom gradscope.cli import app\n"
        "for args in (['--help'], ['--version'], ['summary', 's.parquet']):\n"
        "    try:\n        app(args)\n    except SystemExit as e:\n        assert e.code == 0, args\n"
        "print(sorted({'torch', 'pandas', 'transformers'} & set(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_a_config_without_checkpoint_says_whose_weights_were_scored(tmp_path):
    """A model no file gives weights to is scored as its factory makes it: said after the run,
    once, on stderr; nothing said where a checkpoint is named."""
    config = make_project(tmp_path, n=6, model={"factory": "model.py:Net"})
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    (note,) = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert "names no checkpoint" in note and "model.factory" in note
    assert "note:" not in result.stdout
    (tmp_path / "named").mkdir()
    named = make_project(tmp_path / "named", n=6)
    result = runner.invoke(app, ["norms", str(named)])
    assert result.exit_code == 0 and "note:" not in result.output
