"""What the replay of a recorded run refuses in one line rather than score wrongly: a replay
that is not the run at a small learning rate in float32, where the weights move by less than a
bound of their size; a reference of non-finite loss or one the model cannot take."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import ModelError
from gradscope.training.replay import through_training
from gradscope.training.run import train_model
from gradscope.training.watch import Watch
from tests.project import edit_config, make_project, one_error

SMALL_LR = {"optimizer": "sgd", "lr": 1e-4, "epochs": 2, "batch_size": 4}
MODELS = """
import numpy as np
import torch
from torch import nn

from model import Net


class NumpyDropout(Net):
    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.training:
            h = h * torch.as_tensor(np.random.rand(*h.shape) > 0.3, dtype=h.dtype) / 0.7
        return self.fc2(h)


class TorchDropout(Net):
    def forward(self, x):
        return self.fc2(nn.functional.dropout(torch.tanh(self.fc1(x)), 0.3, self.training))


class Relu(Net):  # the same parameter names as Net's, another function
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
"""


def float32_project(root: Path, factory: str, **config) -> Path:
    """make_project's rows in float32, the models above in other.py, and ref.pt."""
    path = make_project(root, n=12, dtype="float32", model__factory=factory, **config)
    (root / "other.py").write_text(MODELS)
    g = torch.Generator().manual_seed(5)
    ref = {"x": torch.randn(3, 5, generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    torch.save(ref, root / "ref.pt")
    return path


@pytest.mark.parametrize("factory", ["other.py:TorchDropout", "other.py:NumpyDropout"])
def test_dropout_at_a_small_lr_in_float32_replays_only_from_torch(tmp_path, factory):
    """At lr 1e-4 a step moves the weights by about 1e-5, a bound of their size (3.4e-4) let a
    mask the record does not hold through: two replays' scores correlated 0.97. Torch's
    dropout, which the record holds, replays."""
    cfg = load_config(float32_project(tmp_path, factory, train=SMALL_LR))
    run = train_model(cfg, tmp_path / "out.pt", record=True, segment=3).record
    if factory.endswith("TorchDropout"):
        assert np.isfinite(through_training(cfg, run, tmp_path / "ref.pt")).all()
        return
    with pytest.raises(ModelError, match=r"does not reach its weights after step \d+, in segm"):
        through_training(cfg, run, tmp_path / "ref.pt")


def test_a_watched_loop_replayed_with_another_model_is_refused(tmp_path):
    """A float32 loop of Net (tanh) at lr 1e-4, replayed with a config of Relu (its parameter
    names): accepted before, scores correlating 0.84 with the true replay's."""
    cfg = load_config(float32_project(tmp_path, "model.py:Net"))
    data = torch.load(tmp_path / "data.pt")
    torch.manual_seed(0)
    model = runpy.run_path(str(tmp_path / "model.py"))["Net"]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with Watch(model, tmp_path / "w.parquet", "cross_entropy", record=tmp_path / "r.run",
               optimizer=opt, segment=3) as watch:  # fmt: skip
        for ids in torch.arange(12).split(4):
            opt.zero_grad()
            watch.step(data["x"][ids], data["y"][ids], ids).backward()
            opt.step()
    assert np.isfinite(through_training(cfg, tmp_path / "r.run", tmp_path / "ref.pt")).all()
    edit_config(tmp_path, lambda c: c["model"].update(factory="other.py:Relu"))
    other = load_config(tmp_path / "config.yaml")
    with pytest.raises(ModelError, match="is not the model that trained"):
        through_training(other, tmp_path / "r.run", tmp_path / "ref.pt")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A float64 project trained with --record (run.run), and refs: ref.pt, three rows."""
    root = tmp_path_factory.mktemp("recorded")
    config = make_project(root, n=8, dtype="float64", train={**SMALL_LR, "lr": 0.1})
    g = torch.Generator().manual_seed(5)
    ref = {"x": torch.randn(3, 5, generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    torch.save(ref, root / "ref.pt")
    result = CliRunner().invoke(
        app, ["train", str(config), "--record", "--out", str(root / "run.pt")]
    )
    assert result.exit_code == 0, result.output
    return root


def replayed(root: Path, ref: Path, *flags: str):
    """``influence --through-training`` of ``root``'s run against ``ref``, the scores beside it."""
    out = ref.with_suffix(".parquet")
    args = ["influence", root / "config.yaml", "--ref", ref, "--through-training", root / "run.run"]
    return CliRunner().invoke(app, [str(a) for a in [*args, *flags, "--out", out]])


@pytest.mark.parametrize("flags", [(), ("--per-ref",)], ids=["mean", "per-ref"])
def test_a_reference_row_of_non_finite_loss_is_refused_naming_it(recorded, tmp_path, flags):
    """A NaN in REF's row 5 (of its second batch of 4) made the mean's scores NaN, and with
    --per-ref those of every reference of its batch (0 x NaN in the batched backward), written
    with exit status 0."""
    ref = {k: torch.cat([v, v]) for k, v in torch.load(recorded / "ref.pt").items()}
    ref["x"][5, 2] = float("nan")
    torch.save(ref, tmp_path / "nan.pt")
    line = one_error(replayed(recorded, tmp_path / "nan.pt", *flags))
    assert "the reference's row 5: its loss is not finite" in line
    assert line.endswith(f"(--ref {tmp_path / 'nan.pt'})")
    assert not (tmp_path / "nan.parquet").exists()


def test_a_reference_the_model_cannot_take_is_one_line(recorded, tmp_path):
    """REF of 4 features for a model of 5: a traceback ending in torch's shape error."""
    torch.save({"x": torch.randn(3, 4), "y": torch.tensor([0, 1, 2])}, tmp_path / "bad.pt")
    line = one_error(replayed(recorded, tmp_path / "bad.pt"))
    assert "the model's forward raised RuntimeError on REF: mat1 and mat2" in line
    assert line.endswith(f"(--ref {tmp_path / 'bad.pt'})")
