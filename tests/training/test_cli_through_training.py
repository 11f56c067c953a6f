"""``gradscope train --record`` and ``influence --through-training`` through the command line:
the Parquet file against ``through_training``, a record kept right across Ctrl-C and --resume,
and the refusals, each one line."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.training import attribution
from gradscope.training.loop import Trainer
from gradscope.training.replay import through_training
from tests.project import edit_config, make_project, one_error

TRAIN = {"optimizer": "adamw", "lr": 0.05, "epochs": 3, "warmup": 2, "schedule": "cosine",
         "weight_decay": 0.1, "clip": 1.0}  # fmt: skip


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def project(tmp_path):
    config = make_project(tmp_path, n=14, model__checkpoint="out.pt", train=TRAIN, dtype="float64")
    g = torch.Generator().manual_seed(5)
    ref = {"x": torch.randn(3, 5, generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    torch.save(ref, tmp_path / "ref.pt")
    return config


def test_influence_through_training_writes_the_replays_scores(tmp_path, project, monkeypatch):
    result = run("train", project, "--record", "--segment", "4")
    assert result.exit_code == 0, result.output
    assert "out.run\n" in result.output
    want = through_training(
        load_config(project), tmp_path / "out.run", tmp_path / "ref.pt", per_ref=True
    )

    def slow(*args, **kwargs):  # the replay's time is the file's too
        time.sleep(0.5)
        return through_training(*args, **kwargs)

    monkeypatch.setattr(attribution, "through_training", slow)
    result = run("influence", project, "--ref", tmp_path / "ref.pt", "--through-training",
                 tmp_path / "out.run", "--per-ref")  # fmt: skip
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "scores.parquet")
    rows = table.to_pandas().sort_values(["example_id", "ref_id"])
    np.testing.assert_array_equal(rows["influence"].to_numpy(), want.reshape(-1))
    whole = json.loads(table.schema.metadata[b"gradscope"])
    meta = whole["influence"]
    assert meta["method"] == "through-training" and meta["steps"] == 12 and meta["segment"] == 4
    assert not list(tmp_path.glob(".*.replay"))  # the adjoints go once the file is written
    assert np.isfinite(rows["loss"]).all()


def test_the_scores_read_no_checkpoint_of_the_config(tmp_path, project):
    """The rows are scored at the record's last weights: the config's model.checkpoint, which
    this run wrote elsewhere, is neither read nor named in the file (a missing one failed the
    scoring run after the whole replay, and an existing one's sha256 was written as the
    scores' checkpoint)."""
    assert run("train", project, "--record", "--out", tmp_path / "there.pt").exit_code == 0
    assert not (tmp_path / "out.pt").exists()
    result = run("influence", project, "--ref", tmp_path / "ref.pt", "--through-training",
                 tmp_path / "there.run")  # fmt: skip
    assert result.exit_code == 0, result.output
    whole = json.loads(pq.read_table(tmp_path / "scores.parquet").schema.metadata[b"gradscope"])
    assert whole["checkpoint_sha256"] is None
    assert whole["config"]["model"]["checkpoint"] is None
    assert not list(tmp_path.glob(".*.replay"))


def test_limit_and_batch_size_choose_the_rows_shown_not_the_run(tmp_path, project):
    ref, record = tmp_path / "ref.pt", tmp_path / "out.run"
    assert run("train", project, "--record").exit_code == 0
    assert run("influence", project, "--ref", ref, "--through-training", record).exit_code == 0
    whole = pq.read_table(tmp_path / "scores.parquet").to_pandas()
    shown = run("influence", project, "--ref", ref, "--through-training", record, "--limit", "5",
                "--batch-size", "2", "--out", tmp_path / "five.parquet")  # fmt: skip
    assert shown.exit_code == 0, shown.output
    five = pq.read_table(tmp_path / "five.parquet").to_pandas()
    assert list(five["example_id"]) == list(whole["example_id"][:5])
    np.testing.assert_array_equal(five["influence"], whole["influence"][:5])
    np.testing.assert_allclose(five["loss"], whole["loss"][:5], rtol=1e-12)
    every = run("influence", project, "--ref", ref, "--through-training", record, "--limit", "99",
                "--out", tmp_path / "every.parquet")  # fmt: skip
    assert every.exit_code == 0, every.output  # as any command's --limit past the rows
    (tmp_path / "ten").mkdir()
    ten = make_project(tmp_path / "ten", n=14, model__checkpoint="out.pt", train=TRAIN,
                       dtype="float64", data__limit=10)  # fmt: skip
    assert run("train", ten, "--record").exit_code == 0
    past = run("influence", ten, "--ref", ref, "--through-training", tmp_path / "ten" / "out.run",
               "--limit", "12")  # fmt: skip
    assert "the run trained on 10 rows; --limit asks for more" in one_error(past)


def test_a_record_kept_across_ctrl_c_and_resume_is_the_uninterrupted_ones(
    tmp_path, project, monkeypatch
):
    assert (
        run("train", project, "--record", "--segment", "2", "--out", tmp_path / "a.pt").exit_code
        == 0
    )
    step, calls = Trainer._step, []

    def interrupted(self, picked):
        calls.append(1)
        if len(calls) == 10:  # in the third pass of 4 steps
            raise KeyboardInterrupt
        step(self, picked)

    monkeypatch.setattr(Trainer, "_step", interrupted)
    assert run("train", project, "--record", "--segment", "2").exit_code == 130
    monkeypatch.setattr(Trainer, "_step", step)
    torn = tmp_path / "out.run" / ".segment-00003.pt.123-abcd.tmp"  # a kill cut its write short
    torn.write_bytes(b"torn")
    assert run("train", project, "--record", "--segment", "2", "--resume").exit_code == 0
    manifest = json.loads((tmp_path / "out.run" / "manifest.json").read_text())
    assert not torn.exists() and not any(name.endswith(".tmp") for name in manifest)
    cfg = load_config(project)
    a = through_training(cfg, tmp_path / "a.run", tmp_path / "ref.pt")
    b = through_training(cfg, tmp_path / "out.run", tmp_path / "ref.pt")
    np.testing.assert_array_equal(a, b)


def test_refusals_are_one_line(tmp_path, project):
    ref, record = tmp_path / "ref.pt", tmp_path / "out.run"
    assert run("train", project, "--record").exit_code == 0
    (tmp_path / "out.pt").unlink()
    line = one_error(run("train", project, "--record"))
    assert "a run record is there already; pass --overwrite" in line
    line = one_error(
        run("influence", project, "--ref", ref, "--through-training", record, "--curvature", "gn")
    )
    assert "it reads no --curvature" in line
    for flags in (["--damping", "3"], ["--solver", "cg"], ["--cg-tolerance", "0.5"],
                  ["--engine", "jvp"]):  # fmt: skip
        line = one_error(run("influence", project, "--ref", ref, "--through-training", record,
                             *flags))  # fmt: skip
        assert f"it reads no {flags[0]}" in line, line
    (record / "steps.pt").write_bytes((record / "steps.pt").read_bytes()[:-1])
    line = one_error(run("influence", project, "--ref", ref, "--through-training", record))
    assert "the run record's steps.pt changed after it was written" in line
    assert "--segment must be a positive" in one_error(
        run("train", project, "--record", "--segment", "0", "--overwrite")
    )
    assert "pass --record too" in one_error(run("train", project, "--segment", "2", "--overwrite"))
    (tmp_path / "fn").mkdir()
    fn = make_project(tmp_path / "fn", train={"fn": "loop.py:train"}, model__checkpoint="out.pt")
    (tmp_path / "fn" / "loop.py").write_text("def train(model, rows, seed):\n    pass\n")
    assert "cannot record it" in one_error(run("train", fn, "--record"))


def test_an_output_that_is_an_input_is_refused_before_the_replay(tmp_path, project, monkeypatch):
    """The output is checked before the replay, which saves its progress beside it: refused at
    once, nothing left beside the input (it was after the whole replay, its progress kept)."""
    ref, record = tmp_path / "ref.pt", tmp_path / "out.run"
    assert run("train", project, "--record").exit_code == 0
    monkeypatch.setattr(attribution, "through_training", None)  # a replay would fail at once
    for out in (ref, record / "scores.parquet"):
        line = one_error(run("influence", project, "--ref", ref, "--through-training", record,
                             "--out", out))  # fmt: skip
        assert "writing there would" in line
    assert not list(tmp_path.rglob(".*.replay"))


def test_a_killed_replay_continues_with_or_without_resume(tmp_path, project, monkeypatch):
    """The replay's message says: run the same command again; with --resume it was refused
    ("nothing to resume", the scoring run's partial folder being none), now it continues too.
    --resume with no replay to continue is refused before a replay runs."""
    ref, record = tmp_path / "ref.pt", tmp_path / "out.run"
    assert run("train", project, "--record", "--segment", "4").exit_code == 0
    args = ["influence", project, "--ref", ref, "--through-training", record]
    line = one_error(run(*args, "--resume"))
    assert "nothing to resume: no interrupted replay of this output" in line
    assert run(*args, "--out", tmp_path / "whole.parquet").exit_code == 0
    replay, walked = attribution.through_training, []

    def killed(*a, on_step, **kw):
        def step(n: int) -> None:
            walked.append(n)
            if len(walked) == 6:  # in the second segment of three walked back
                raise KeyboardInterrupt
            on_step(n)

        return replay(*a, on_step=step, **kw)

    monkeypatch.setattr(attribution, "through_training", killed)
    assert run(*args).exit_code == 130
    monkeypatch.setattr(attribution, "through_training", replay)
    assert len(list(tmp_path.glob(".*.replay"))) == 1
    assert run(*args, "--resume").exit_code == 0
    got, want = (
        pq.read_table(tmp_path / f).to_pandas() for f in ("scores.parquet", "whole.parquet")
    )
    np.testing.assert_array_equal(got["influence"], want["influence"])
    assert not list(tmp_path.glob(".*.replay"))


ACT_PY = "import torch\n\ndef act(x):\n    return torch.{}(x)\n"
ACTED_PY = """
from act import act
from model import Net


class Acted(Net):
    def forward(self, x):
        return self.fc2(act(self.fc1(x)))
"""


def test_a_record_replays_only_with_the_code_that_trained_it(tmp_path, project):
    """The record keyed the files the config names, not the modules its factory imports: one
    edited after training replayed another model without a word. What changes no step (the
    classes' names, epoch checkpoints) no longer refuses a record."""
    (tmp_path / "act.py").write_text(ACT_PY.format("tanh"))
    (tmp_path / "acted.py").write_text(ACTED_PY)
    edit_config(tmp_path, lambda c: c["model"].update(factory="acted.py:Acted"))
    ref, record = tmp_path / "ref.pt", tmp_path / "out.run"
    assert run("train", project, "--record").exit_code == 0
    edit_config(tmp_path, lambda c: (c["data"].update(classes=["a", "b", "c"]),
                                     c["train"].update(save_every=1)))  # fmt: skip
    result = run("influence", project, "--ref", ref, "--through-training", record)
    assert result.exit_code == 0, result.output
    (tmp_path / "act.py").write_text(ACT_PY.format("relu"))
    line = one_error(run("influence", project, "--ref", ref, "--through-training", record,
                         "--out", tmp_path / "b.parquet"))  # fmt: skip
    assert "the run record was made with a different file" in line and "act.py" in line
