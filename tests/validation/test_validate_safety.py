"""Retraining is the cost: a crash or Ctrl-C loses no finished model, ``--resume`` continues only
the same run, a truth file is reused (never for another recipe), processes share the work, and
bad input is one ``error:`` line before anything trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from problem import ROWS, make_problem
from project import edit_config, edit_data, made_by_code, one_error
from typer.testing import CliRunner

from gradscope import training
from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import Interrupted, ModelError
from gradscope.io.parquet import partial_path
from gradscope.validation import Options, validate

TASKS = 8  # --subsets 4 --seeds 2
FIT = training.fit


def counting_fit(monkeypatch, stop: int | None = None, error: type = RuntimeError) -> list:
    """``fit`` as it is, counting its calls; raising ``error`` at call number ``stop``."""
    calls = []

    def fit(cfg, rows=None, *, seed=None):
        if len(calls) == stop:
            raise error("stopped by the test")
        calls.append(seed)
        return FIT(cfg, rows, seed=seed)

    monkeypatch.setattr(training, "fit", fit)
    return calls


def scores(root):
    pq.write_table(
        pa.table({"example_id": np.arange(ROWS), "influence": np.linspace(-1, 1, ROWS)}),
        root / "s.parquet",
    )
    return root / "s.parquet"


def invoke(root, *more):
    args = ["validate", str(root / "config.yaml"), "--ref", str(root / "ref.pt"),
            "--scores", str(root / "s.parquet"), "--subsets", "4", "--seeds", "2",
            "--out", str(root / "v.parquet"), *map(str, more)]  # fmt: skip
    return CliRunner().invoke(app, args)


def truth(root) -> pd.DataFrame:
    return pd.read_parquet(root / "v.truth.parquet").drop(columns="seconds")


def test_interrupt_and_crash_lose_no_model(tmp_path, monkeypatch):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for root in (whole, cut):
        root.mkdir()
        make_problem(root)
        scores(root)
    assert invoke(whole).exit_code == 0
    counting_fit(monkeypatch, stop=3, error=KeyboardInterrupt)
    result = invoke(cut)
    assert result.exit_code == 130 and "3 retrained models saved" in result.output
    assert len(list(partial_path(cut / "v.truth.parquet").glob("part-*"))) == 3
    # without --resume, the same command threw the three models away and started over
    line = one_error(invoke(cut))
    assert "an interrupted run of this same command saved 3 retrained models" in line
    assert "run it with --resume to continue, or remove the folder to start over" in line
    assert len(list(partial_path(cut / "v.truth.parquet").glob("part-*"))) == 3
    counting_fit(monkeypatch, stop=2)  # a crash: the exception as it is
    assert isinstance(invoke(cut, "--resume").exception, RuntimeError)
    calls = counting_fit(monkeypatch)
    assert invoke(cut, "--resume").exit_code == 0
    assert len(calls) == TASKS - 5  # no finished model trained again
    pd.testing.assert_frame_equal(truth(cut), truth(whole))
    assert not partial_path(cut / "v.truth.parquet").exists()


def test_an_interrupt_after_the_truth_is_written_says_so(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) as the table is measured: the truth file is whole, and the line says
    so (it said "interrupted before any example was saved"); the next run trains nothing."""
    import importlib

    module = importlib.import_module("gradscope.validation.validate")

    make_problem(tmp_path)
    scores(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_table", interrupted)
    result = invoke(tmp_path)
    assert result.exit_code == 130 and "after the truth file was written" in result.output
    monkeypatch.undo()
    counting_fit(monkeypatch, stop=0)  # any retrain fails the test
    assert invoke(tmp_path).exit_code == 0


def test_resume_refuses_another_recipe(tmp_path, monkeypatch):
    make_problem(tmp_path)
    scores(tmp_path)
    counting_fit(monkeypatch, stop=2, error=KeyboardInterrupt)
    assert invoke(tmp_path).exit_code == 130
    config = tmp_path / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["train"]["lr"] = 0.1
    config.write_text(yaml.safe_dump(raw))
    line = one_error(invoke(tmp_path, "--resume"))
    assert "cannot resume" in line and "train.lr" in line


def test_truth_reused_not_for_another_recipe(tmp_path, monkeypatch):
    make_problem(tmp_path)
    scores(tmp_path)
    result = invoke(tmp_path)
    assert result.exit_code == 0
    # four subsets: a random ranking reaches +-1 with probability 2/4! = 0.083, said so
    assert "with probability 0.083" in " ".join(result.output.split())
    first = pd.read_parquet(tmp_path / "v.parquet")
    counting_fit(monkeypatch, stop=0)  # any retrain fails the test
    (tmp_path / "v.parquet").unlink()
    assert invoke(tmp_path).exit_code == 0
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "v.parquet"), first)
    assert "subsets 4" in one_error(invoke(tmp_path, "--subsets", 5))
    config = tmp_path / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["train"]["lr"] = 0.1
    config.write_text(yaml.safe_dump(raw))
    line = one_error(invoke(tmp_path))
    assert "truth file was made with a different train.lr" in line


def test_truth_not_reused_once_a_module_the_factory_imports_changed(tmp_path, monkeypatch):
    """The factory's file unchanged, a module it imports from beside it edited: the models
    retrained would differ, so the truth is refused (it was reused without a word)."""
    make_problem(tmp_path)
    (tmp_path / "truth_sizes.py").write_text("CLASSES = 3\n")
    (tmp_path / "model.py").write_text(
        "from torch import nn\n\nimport truth_sizes\n\n\nclass Logistic(nn.Linear):\n"
        "    def __init__(self):\n        super().__init__(2, truth_sizes.CLASSES)\n"
    )
    scores(tmp_path)
    assert invoke(tmp_path).exit_code == 0
    counting_fit(monkeypatch, stop=0)  # any retrain fails the test
    (tmp_path / "truth_sizes.py").write_text("CLASSES = 3  # the same, or not\n")
    line = one_error(invoke(tmp_path))
    assert "truth file was made with a different code.truth_sizes.py" in line


def test_truth_not_reused_once_code_made_data_makes_other_rows(tmp_path, monkeypatch):
    """``data.path: rows.py:make`` reading a file the config does not name, which then
    changes: no file's hash holds the rows, so the truth keeps their sha256 and is refused (it
    was reused, every model trained on the old rows)."""
    make_problem(tmp_path)
    edit_config(tmp_path, lambda c: c["data"].update(path=made_by_code(tmp_path)))
    scores(tmp_path)
    assert invoke(tmp_path).exit_code == 0
    counting_fit(monkeypatch, stop=0)  # any retrain fails the test
    (tmp_path / "v.parquet").unlink()
    assert invoke(tmp_path).exit_code == 0  # the same rows: reused
    edit_data(tmp_path, lambda d: d["x"][3].add_(1))
    line = one_error(invoke(tmp_path))
    assert "truth file was made with a different data.sha256" in line


def test_truth_extended_by_the_models_a_run_adds(tmp_path, monkeypatch):
    """A truth without removal models, then --removal: only those are trained, added to the
    truth beside its subsets, and the table is the one a run from scratch gives."""
    make_problem(tmp_path)
    scores(tmp_path)
    assert invoke(tmp_path, "--removal", 2, "--out", tmp_path / "scratch.parquet").exit_code == 0
    assert invoke(tmp_path).exit_code == 0
    calls = counting_fit(monkeypatch)
    assert invoke(tmp_path, "--removal", 2).exit_code == 0
    assert len(calls) == 2 * (1 + 2)  # seeds x (the full data, top-2 and random-2 removed)
    extended = truth(tmp_path)
    assert list(extended["kind"]) == ["subset"] * TASKS + ["full"] * 2 + ["removed", "random"] * 2
    pd.testing.assert_frame_equal(
        extended, pd.read_parquet(tmp_path / "scratch.truth.parquet").drop(columns="seconds")
    )
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "v.parquet"), pd.read_parquet(tmp_path / "scratch.parquet")
    )


@pytest.mark.slow  # two spawned processes each import torch
def test_processes_train_the_same_models(tmp_path):
    make_problem(tmp_path)
    scores(tmp_path)
    assert invoke(tmp_path, "--jobs", 2).exit_code == 0
    spread = truth(tmp_path)
    (tmp_path / "v.truth.parquet").unlink()
    assert invoke(tmp_path).exit_code == 0
    pd.testing.assert_frame_equal(spread, truth(tmp_path))


@pytest.mark.slow  # two spawned processes each import torch
def test_interrupted_processes_keep_every_finished_model(tmp_path, monkeypatch):
    """Ctrl-C as the first model is kept: the model the other process is training finishes
    and is kept too; a resume trains only the rest."""
    make_problem(tmp_path)
    scores(tmp_path)
    assert invoke(tmp_path).exit_code == 0
    whole = truth(tmp_path)
    (tmp_path / "v.truth.parquet").unlink()

    def interrupt(_):
        raise KeyboardInterrupt

    cfg = load_config(tmp_path / "config.yaml")
    options = Options(subsets=4, seeds=2, jobs=2)
    with pytest.raises(Interrupted):
        validate(cfg, str(tmp_path / "ref.pt"), [tmp_path / "s.parquet"], options=options,
                 out=tmp_path / "v.parquet", on_model=interrupt)  # fmt: skip
    saved = len(list(partial_path(tmp_path / "v.truth.parquet").glob("part-*")))
    assert saved >= 2
    calls = counting_fit(monkeypatch)
    assert invoke(tmp_path, "--resume").exit_code == 0
    assert len(calls) == TASKS - saved
    pd.testing.assert_frame_equal(truth(tmp_path), whole)


@pytest.mark.slow  # two torchrun ranks each import torch
def test_torchrun_ranks_share_the_models(tmp_path):
    make_problem(tmp_path)
    scores(tmp_path)
    args = ["validate", str(tmp_path / "config.yaml"), "--ref", str(tmp_path / "ref.pt"),
            "--scores", str(tmp_path / "s.parquet"), "--subsets", "4", "--seeds", "2",
            "--out", str(tmp_path / "v.parquet")]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "gradscope", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote ") == 1  # only rank 0 reports
    ranks = truth(tmp_path)
    (tmp_path / "v.truth.parquet").unlink()
    assert invoke(tmp_path).exit_code == 0
    pd.testing.assert_frame_equal(ranks, truth(tmp_path))


def other_ref(root):
    table = pq.read_table(root / "s.parquet")
    meta = {b"gradscope": json.dumps({"influence": {"ref_sha256": "0" * 64}})}
    pq.write_table(table.replace_schema_metadata(meta), root / "s.parquet")


def wide_ref(root):
    torch.save({"x": torch.zeros(3, 5, dtype=torch.float64), "y": torch.zeros(3).long()},
               root / "ref.pt")  # fmt: skip


def nan_ref(root):
    ref = torch.load(root / "ref.pt")
    ref["x"][2, 0] = float("nan")
    torch.save(ref, root / "ref.pt")


def nan_row(root):
    edit_data(root, lambda d: d["x"].__setitem__((5, 1), float("nan")))


def no_train(root):
    raw = yaml.safe_load((root / "config.yaml").read_text())
    del raw["train"]
    (root / "config.yaml").write_text(yaml.safe_dump(raw))


def mse(root):
    raw = yaml.safe_load((root / "config.yaml").read_text())
    raw["loss"] = {"name": "mse"}
    (root / "config.yaml").write_text(yaml.safe_dump(raw))


@pytest.mark.parametrize(
    "change, more, message",
    [
        (None, ["--fraction", 0], "--fraction must lie in (0, 1)"),
        (None, ["--fraction", 1.5], "--fraction must lie in (0, 1)"),
        (None, ["--subsets", 1], "--subsets must be at least 2"),
        (None, ["--removal", 0], "--removal must be at least 1"),
        (None, ["--removal", ROWS], "--removal 40 leaves none of the 40 training rows"),
        (None, ["--fraction", 0.01], "keeps 0; a subset must keep a row"),
        (no_train, [], "no 'train' section"),
        (other_ref, [], "against another REF"),
        (wide_ref, [], "the model's forward raised RuntimeError on REF"),
        # every model's loss there NaN: its LDS was "-" with no reason given
        (nan_ref, [], "REF example 2's loss is nan under the model as training begins it"),
        # a retrain keeping it diverged mid-run, naming neither the row nor the model
        (nan_row, [], "training row 5's loss is nan under the model as training begins it"),
        (mse, ["--target", "margin"], "--target margin needs a classification loss"),
        (None, ["--bad", "nonesuch"], "no column 'nonesuch' for --bad"),
        (None, ["--column", "cosine"], "no 'cosine' column"),
        (None, ["--bad", "x"], "the --bad column 'x' is not one value per row"),
        (None, ["--out", "v.json"], "is the JSON beside the table: name the .parquet"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_before_training(tmp_path, monkeypatch, change, more, message):
    make_problem(tmp_path)
    scores(tmp_path)
    if change:
        change(tmp_path)
    counting_fit(monkeypatch, stop=0)
    assert message in one_error(invoke(tmp_path, *more))
    assert not (tmp_path / "v.truth.parquet").exists()


def test_interrupt_while_the_truth_is_written_keeps_every_model(tmp_path, monkeypatch):
    from gradscope.io.parquet import PartialRun

    make_problem(tmp_path)
    scores(tmp_path)
    assemble = PartialRun.assemble

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(PartialRun, "assemble", interrupted)
    result = invoke(tmp_path)
    assert result.exit_code == 130 and "every model saved" in result.output
    monkeypatch.setattr(PartialRun, "assemble", assemble)
    calls = counting_fit(monkeypatch)
    assert invoke(tmp_path, "--resume").exit_code == 0
    assert calls == [] and len(truth(tmp_path)) == TASKS


def test_a_retrain_that_diverges_is_named(tmp_path, monkeypatch):
    """A retrain that diverged mid-run stopped the validation naming neither model nor seed."""
    make_problem(tmp_path)
    scores(tmp_path)
    counting_fit(monkeypatch, stop=2, error=ModelError)
    line = one_error(invoke(tmp_path))
    assert "stopped by the test; in the retrain on subset " in line and ", seed " in line
