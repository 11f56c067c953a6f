"""``gradscope train`` through the command line: the checkpoint it writes, epoch checkpoints,
the run's safety (an existing checkpoint, Ctrl-C and --resume) and bad recipes."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.training import fit
from gradscope.training.loop import Trainer
from tests.project import edit_config, edit_data, made_by_code, make_project, one_error

DROPOUT_PY = """
import torch
from torch import nn

from model import Net


class Dropped(Net):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))
"""


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_writes_what_fit_trains_and_norms_reads_it(tmp_path):
    config = make_project(tmp_path, model__checkpoint="trained.pt",
                          train={"optimizer": "adam", "lr": 0.05, "epochs": 3})  # fmt: skip
    result = run("train", config)
    assert result.exit_code == 0, result.output
    assert "23 rows, 18 steps" in result.output and "wrote" in result.output
    assert same(torch.load(tmp_path / "trained.pt"), fit(load_config(config)).state_dict())
    assert not list(tmp_path.glob(".*partial"))
    assert run("norms", config).exit_code == 0


def test_an_existing_checkpoint_is_kept_without_overwrite(tmp_path):
    config = make_project(tmp_path, train={"epochs": 1})
    before = (tmp_path / "net.pt").read_bytes()
    line = one_error(run("train", config))
    assert "a checkpoint is there already; pass --overwrite" in line
    assert (tmp_path / "net.pt").read_bytes() == before
    assert run("train", config, "--overwrite").exit_code == 0
    assert (tmp_path / "net.pt").read_bytes() != before


@pytest.mark.parametrize("kind", ["link", "file", "holds the data"])
def test_overwrite_replaces_a_run_record_alone(tmp_path, kind):
    """``--record --overwrite`` deletes the record folder there: never one that is a link, a
    file, or a folder holding what no record writes (the training data, in the last case)."""
    config = make_project(tmp_path, train={"epochs": 1})
    run_folder = tmp_path / "net.run"
    if kind == "link":
        (tmp_path / "mine").mkdir()
        run_folder.symlink_to(tmp_path / "mine")
    elif kind == "file":
        run_folder.write_text("mine")
    else:
        run_folder.mkdir()
        (tmp_path / "data.pt").rename(run_folder / "data.pt")
        edit_config(tmp_path, lambda raw: raw["data"].update(path=str(run_folder / "data.pt")))
    line = one_error(run("train", config, "--record", "--overwrite"))
    assert ("not a run record's folder" if kind != "holds the data" else "holds data.pt") in line
    assert run_folder.exists() and (kind != "holds the data" or (run_folder / "data.pt").exists())


def test_epoch_checkpoints_and_their_tracin_weights(tmp_path):
    config = make_project(tmp_path, train={"lr": 0.1, "epochs": 4, "save_every": 2,
                                           "schedule": "linear"})  # fmt: skip
    result = run("train", config, "--out", tmp_path / "m.pt")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.epoch2.pt").is_file() and not (tmp_path / "m.epoch4.pt").exists()
    # 6 steps a pass: the mean learning rate of steps 0-11, then 12-23, of a linear decay
    first = sum(0.1 * (1 - s / 24) for s in range(12)) / 12
    assert f"{{path: m.epoch2.pt, weight: {first:.4g}}}" in result.output
    assert "{path: m.pt, weight:" in result.output


def test_epoch_checkpoints_replace_no_input_and_nothing_unasked(tmp_path):
    """save_every wrote m.epoch2.pt over whatever lay there: the run's data file named so, or
    a file of the user's, without --overwrite."""
    train = {"lr": 0.1, "epochs": 4, "save_every": 2, "warmup": 20}
    config = make_project(tmp_path, train=train)
    (tmp_path / "m.epoch2.pt").write_bytes((tmp_path / "data.pt").read_bytes())
    edit_config(tmp_path, lambda c: c["data"].update(path="m.epoch2.pt"))
    line = one_error(run("train", config, "--out", tmp_path / "m.pt", "--overwrite"))
    assert "the output path is the run's data.path" in line, line
    edit_config(tmp_path, lambda c: c["data"].update(path="data.pt"))
    line = one_error(run("train", config, "--out", tmp_path / "m.pt"))
    assert "an epoch checkpoint is there already; pass --overwrite" in line, line
    assert run("train", config, "--out", tmp_path / "m.pt", "--overwrite").exit_code == 0


@pytest.mark.parametrize("dropout", [False, True])
def test_ctrl_c_then_resume_is_the_uninterrupted_run(tmp_path, monkeypatch, dropout):
    """Interrupted in its third pass, resumed: the weights of a run never interrupted, also
    when the model draws dropout masks (the random state is part of what is saved)."""
    (tmp_path / "drop.py").write_text(DROPOUT_PY)
    factory = {"model__factory": "drop.py:Dropped"} if dropout else {}
    config = make_project(tmp_path, model__checkpoint="out.pt", **factory,
                          train={"optimizer": "adamw", "lr": 0.05, "epochs": 4, "warmup": 3,
                                 "schedule": "cosine"})  # fmt: skip
    step = Trainer._step
    calls = []

    def interrupted(self, picked):
        calls.append(1)
        if len(calls) == 14:  # in the third pass of 6 steps
            raise KeyboardInterrupt
        step(self, picked)

    monkeypatch.setattr(Trainer, "_step", interrupted)
    result = run("train", config)
    assert result.exit_code == 130 and "interrupted after epoch 2" in result.stderr
    assert not (tmp_path / "out.pt").exists()
    monkeypatch.setattr(Trainer, "_step", step)
    result = run("train", config, "--resume")
    assert result.exit_code == 0, result.output
    assert same(torch.load(tmp_path / "out.pt"), fit(load_config(config)).state_dict())


def interrupted_at_step_7(monkeypatch, config) -> None:
    """``gradscope train config`` stopped by Ctrl-C at step 7 (in its second pass of 6)."""
    step = Trainer._step

    def interrupted(self, picked):
        if self.step == 7:
            raise KeyboardInterrupt
        step(self, picked)

    monkeypatch.setattr(Trainer, "_step", interrupted)
    assert run("train", config).exit_code == 130
    monkeypatch.setattr(Trainer, "_step", step)


def test_resume_over_data_made_by_code_needs_its_rows(tmp_path, monkeypatch):
    """``data.path: rows.py:make`` reads data.pt, which no config names: changed between the
    interrupt and --resume, the rest of the run would train on other rows."""
    config = make_project(tmp_path, model__checkpoint="out.pt", train={"epochs": 3})
    edit_config(tmp_path, lambda c: c["data"].update(path=made_by_code(tmp_path)))
    interrupted_at_step_7(monkeypatch, config)
    rows = torch.load(tmp_path / "data.pt")
    edit_data(tmp_path, lambda d: d["x"][0].add_(1))
    assert "a different data made by code" in one_error(run("train", config, "--resume"))
    torch.save(rows, tmp_path / "data.pt")
    assert run("train", config, "--resume").exit_code == 0
    assert same(torch.load(tmp_path / "out.pt"), fit(load_config(config)).state_dict())


def test_resume_refuses_another_recipe_and_no_run(tmp_path, monkeypatch):
    config = make_project(tmp_path, model__checkpoint="out.pt", train={"epochs": 3})
    assert "nothing to resume" in one_error(run("train", config, "--resume"))
    step = Trainer._step
    calls = []

    def interrupted(self, picked):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        step(self, picked)

    monkeypatch.setattr(Trainer, "_step", interrupted)
    assert run("train", config).exit_code == 130
    # a run with --record after one without (its default segment was the key's None): the
    # resume raised KeyError 'record'; the reverse left a record that could never be finished
    assert "a different record" in one_error(run("train", config, "--record", "--resume"))
    edit_config(tmp_path, lambda c: c["train"].update(lr=0.5))
    assert "a different config.train.lr" in one_error(run("train", config, "--resume"))


USER_FN = """
import numpy as np
import torch


def train(model, rows, seed):
    assert isinstance(rows, np.ndarray) and rows.dtype == np.int64
    with torch.no_grad():
        model.fc2.bias.fill_(float(len(rows) + seed))


def returns_text(model, rows, seed):
    return "done"


def raises(model, rows, seed):
    raise ValueError("no GPU here")


def exits(model, rows, seed):
    raise SystemExit(3)


def nan(model, rows, seed):
    with torch.no_grad():
        model.fc1.weight.fill_(float("nan"))


def another(model, rows, seed):
    return torch.nn.Linear(5, 3)


def halved(model, rows, seed):
    return model.half()
"""


def test_train_fn_trains_in_place(tmp_path):
    (tmp_path / "loop.py").write_text(USER_FN)
    config = make_project(tmp_path, model__checkpoint="out.pt",
                          train={"fn": "loop.py:train", "seed": 4})  # fmt: skip
    assert run("train", config).exit_code == 0
    assert torch.equal(torch.load(tmp_path / "out.pt")["fc2.bias"], torch.full((3,), 27.0))


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"optimizer": "rmsprop"}, "'train.optimizer' must be one of sgd, adam, adamw"),
        ({"schedule": "step"}, "'train.schedule' must be one of constant, linear, cosine"),
        ({"epochs": 2, "steps": 5}, "set train.epochs or train.steps, not both"),
        ({"steps": 5, "warmup": 6}, "train.warmup is 6 steps and the run takes 5"),
        ({"lr": -0.1}, "'train.lr' must be a finite number >= 0"),
        ({"betas": [0.9]}, "'train.betas' must be two numbers in [0, 1)"),
        ({"nesterov": True}, "'train.nesterov' needs optimizer sgd with a momentum > 0"),
        ({"epochs": 0}, "'train.epochs' must be at least 1"),
        ({"clip": 0}, "'train.clip' must be a positive number"),
        ({"seed": -1}, "'train.seed' must be at least 0"),
        ({"momentun": 0.9}, "unknown key 'train.momentun'"),
        ({"fn": "loop.py:returns_text"}, "train.fn returned a str; return the trained model"),
        ({"fn": "loop.py:raises"}, "train.fn raised ValueError: no GPU here"),
        ({"fn": "loop.py:missing"}, "train.fn"),
        ({"fn": "loop.py:exits"}, "train.fn raised SystemExit: 3"),
        ({"fn": "loop.py:nan"}, "train.fn left weight fc1.weight NaN or infinite"),  # saved
        # saved, and read by validate as REF's error
        ({"fn": "loop.py:another"}, "weights do not fit model.factory's (no fc1.bias)"),
        (
            {"fn": "loop.py:halved"},
            "(fc1.weight is [8, 5] float16, model.factory's [8, 5] float32)",
        ),
        ({"fn": "loop.py:train", "lr": 5}, "'train.lr' is the recipe's; train.fn does not read it"),
        ({"optimizer": "adam", "momentum": 0.9}, "'train.momentum' is not optimizer adam's"),
        ({"betas": [0.8, 0.9]}, "'train.betas' is not optimizer sgd's"),
        ({"lr": 1e300}, "step 1's update failed: value cannot be converted"),
        (None, "the config has no 'train' section"),
    ],
)
def test_bad_recipes_are_one_line(tmp_path, train, message):
    (tmp_path / "loop.py").write_text(USER_FN)
    config = make_project(tmp_path, model__checkpoint="out.pt")
    if train is not None:
        edit_config(tmp_path, lambda c: c.update(train=train))
    line = one_error(run("train", config))
    assert message in line, line
    assert not (tmp_path / "out.pt").exists()


def test_the_output_may_not_be_an_input(tmp_path):
    config = make_project(tmp_path, train={})
    line = one_error(run("train", config, "--out", tmp_path / "data.pt"))
    assert "the output path is the run's data.path" in line
    raw = yaml.safe_load(config.read_text())
    assert raw["model"]["checkpoint"] == "net.pt"


def test_a_nan_in_the_rows_is_one_line(tmp_path):
    config = make_project(tmp_path, model__checkpoint="out.pt", train={"steps": 9})
    edit_data(tmp_path, lambda d: d["x"].__setitem__((19, 2), float("nan")))
    line = one_error(run("train", config))
    assert "training diverged: the loss is nan at step" in line
    assert "row 19's own being nan (a NaN or infinite value in it?)" in line
    assert not (tmp_path / "out.pt").exists()


def test_an_interrupted_run_is_kept_unless_told(tmp_path, monkeypatch):
    """Run again without --resume, an interrupted run's saved state was thrown away and the run
    started over: refused now, the state kept; --overwrite starts over."""
    config = make_project(tmp_path, model__checkpoint="out.pt", train={"epochs": 3})
    interrupted_at_step_7(monkeypatch, config)
    state = tmp_path / ".out.pt.partial" / "state.pt"
    saved = state.read_bytes()
    line = one_error(run("train", config))
    assert "an interrupted run of this same command saved its training state" in line
    assert "run it with --resume to continue, or pass --overwrite to start over" in line
    assert state.read_bytes() == saved
    assert run("train", config, "--overwrite").exit_code == 0
    assert same(torch.load(tmp_path / "out.pt"), fit(load_config(config)).state_dict())


ACT_PY = "import torch\n\ndef act(x):\n    return torch.tanh(x)\n"
ACTED_PY = """
from act import act
from model import Net


class Acted(Net):
    def forward(self, x):
        return self.fc2(act(self.fc1(x)))
"""


def test_no_output_over_the_code_or_the_record_it_makes(tmp_path):
    """A module the factory imports was overwritten by --overwrite; --record with an output
    named .run trained the whole run, then could not write the checkpoint over its record."""
    (tmp_path / "act.py").write_text(ACT_PY)
    (tmp_path / "acted.py").write_text(ACTED_PY)
    config = make_project(tmp_path, model__factory="acted.py:Acted", train={"epochs": 1})
    line = one_error(run("train", config, "--out", tmp_path / "act.py", "--overwrite"))
    assert "the output path is the run's code act.py" in line
    assert (tmp_path / "act.py").read_text() == ACT_PY
    line = one_error(run("train", config, "--record", "--out", tmp_path / "x.run"))
    assert "its own run record's folder" in line
    assert not (tmp_path / "x.run").exists()


def test_epoch_checkpoints_listed_as_the_config_reads_them(tmp_path):
    """The list printed for model.checkpoints named bare file names: relative to the config's
    folder, as the config reads them."""
    config = make_project(tmp_path, train={"epochs": 2, "save_every": 1})
    (tmp_path / "sub").mkdir()
    result = run("train", config, "--out", tmp_path / "sub" / "m.pt")
    assert result.exit_code == 0, result.output
    assert "{path: sub/m.epoch1.pt, weight:" in result.output
    assert "{path: sub/m.pt, weight:" in result.output
