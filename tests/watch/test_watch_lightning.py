"""The watch as a Lightning callback: the run trains as it would without it, and writes a
row per example and step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from gradscope.errors import ConfigError  # noqa: E402
from gradscope.training.watch import Watch  # noqa: E402
from gradscope.training.watch_lightning import WatchCallback  # noqa: E402


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y, _ = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none").mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _fit(callbacks, accumulate, module=None, clip=0.5):
    torch.manual_seed(1)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    data = torch.utils.data.TensorDataset(x, y, torch.arange(8))
    module = _Module() if module is None else module
    trainer = pl.Trainer(
        max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
        callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    module.logged = dict(trainer.callback_metrics)
    return module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_trains_as_without_the_watch_and_writes_each_step(tmp_path, accumulate):
    plain = _fit([], accumulate)
    watched = _fit([WatchCallback(tmp_path / "w.parquet")], accumulate)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)  # batches of 4: the mean's gradient bit for bit
    assert "training_step" not in watched.__dict__
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert table["example_id"] == list(range(8)) * 2
    assert table["epoch"] == [0] * 8 + [1] * 8


class _Stepped(_Module):
    """A module whose training_step is ``step(module, x, y)``, logged; it counts its forwards."""

    def __init__(self, step, manual=False):
        super().__init__()
        self.step, self.automatic_optimization = step, not manual
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def training_step(self, batch, _):
        x, y, _ = batch
        self.log("logged", 1.0)
        return self.step(self, x, y)


def _as_dict(module, x, y):
    return {"loss": nn.functional.cross_entropy(module(x), y)}


def test_the_first_steps_check_runs_the_modules_step_unlogged(tmp_path):
    plain = _fit([], 1, _Stepped(_as_dict))
    watched = _fit([WatchCallback(tmp_path / "w.parquet")], 1, _Stepped(_as_dict))
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    assert "logged" in plain.logged and "logged" not in watched.logged  # once, muted
    assert watched.calls == plain.calls == 4  # the check's forward not counted


OTHERS = {  # a training_step of another loss than the watch's, or of inputs it changes
    "smoothed": lambda m, x, y: nn.functional.cross_entropy(m(x), y, label_smoothing=0.1),
    "penalised": lambda m, x, y: (nn.functional.cross_entropy(m(x), y)
                                  + 1e-2 * sum(p.square().sum() for p in m.parameters())),
    "augmented": lambda m, x, y: nn.functional.cross_entropy(m(x + 0.1 * torch.randn_like(x)), y),
}  # fmt: skip


@pytest.mark.parametrize("step", OTHERS.values(), ids=OTHERS)
def test_a_training_step_of_another_loss_is_refused(tmp_path, step):
    """Before, each trained on the watch's loss without a word: 0.06 to 0.26 of the largest
    weight from the plain run after two epochs."""
    with pytest.raises(ConfigError, match="as _Stepped's training_step takes it"):
        _fit([WatchCallback(tmp_path / "w.parquet")], 1, _Stepped(step))
    assert not (tmp_path / "w.parquet").exists()  # no rows of a loss it did not train on


def _penalised_from(epoch: int = 0, step: int = 0):
    """The cross entropy, plus a penalty on the weights from ``epoch`` or global ``step`` on."""

    def loss(m, x, y):
        plain = nn.functional.cross_entropy(m(x), y)
        late = m.current_epoch >= epoch and m.global_step >= step
        return plain + 1e-2 * sum(p.square().sum() for p in m.parameters()) if late else plain

    return loss


@pytest.mark.parametrize(("changes", "at"), [({"epoch": 1}, 2), ({"step": 1}, 1)])
def test_a_loss_that_changes_later_is_refused_where_it_is_checked(tmp_path, changes, at):
    """Checked on each epoch's first step and the 2nd, 4th, 8th... (before, the first alone:
    the run trained the watch's loss from there on): refused at that step, the watch file
    keeping the steps trained before it."""
    with pytest.raises(ConfigError, match=f"step {at}'s loss is"):
        _fit([WatchCallback(tmp_path / "w.parquet")], 1, _Stepped(_penalised_from(**changes)))
    assert pq.read_table(tmp_path / "w.parquet").to_pydict()["step"] == [
        step for step in range(at) for _ in range(4)
    ]


class _Fitted(pl.LightningModule):
    """A float32 module that fits its 8 rows to a loss below 1e-5, its step's cross entropy
    written out (``logsumexp - z_y``: rounded otherwise than the watch's); the losses its
    checked steps returned in ``checked``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.checked = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 3)), []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y, _ = batch
        z = self(x)
        loss = (torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0]).mean()
        self.checked.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.9)


def test_a_float32_loss_near_zero_is_checked_no_finer_than_the_first(tmp_path):
    """float32's rounding does not fall as the loss does: checked to 1e-4 of itself, the
    loss of 9e-7 on step 12 (8.6e-7 as the watch rounds it) was refused."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 5) * 3, torch.randint(0, 3, (8,))
    data = torch.utils.data.TensorDataset(x, y, torch.arange(8))
    module = _Fitted()
    trainer = pl.Trainer(
        max_epochs=10, callbacks=[WatchCallback(tmp_path / "w.parquet")], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert len(module.checked) == 11 and min(module.checked) < 1e-5  # steps 0, 1, 2, 4, 6...


class _AtChance(_Stepped):
    """Its head initialised at zero: every class 1/3 on the first batch, where class weights
    and label smoothing give the plain loss's value, not its gradient."""

    def __init__(self, step):
        super().__init__(step)
        nn.init.zeros_(self.net[2].weight)
        nn.init.zeros_(self.net[2].bias)


AT_CHANCE = {
    "smoothed": OTHERS["smoothed"],
    "weighted": lambda m, x, y: nn.functional.cross_entropy(
        m(x), y, weight=torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    ),
}


@pytest.mark.parametrize("step", AT_CHANCE.values(), ids=AT_CHANCE)
def test_a_loss_of_the_same_value_at_chance_is_refused_by_its_gradient(tmp_path, step):
    """Before, the values agreed (log 3) and each trained on the watch's loss: 0.08 and 0.61
    of the largest weight from the plain run (lr 0.5, two epochs)."""
    with pytest.raises(ConfigError, match=r"1\.09861 too, yet of another gradient"):
        _fit([WatchCallback(tmp_path / "w.parquet")], 1, _AtChance(step))
    plain = _fit([], 1, _AtChance(_as_dict))
    watched = _fit([WatchCallback(tmp_path / "w.parquet")], 1, _AtChance(_as_dict))
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)  # the plain loss at chance passes


def _manual(module, x, y):
    opt = module.optimizers()
    opt.zero_grad()
    module.manual_backward(nn.functional.cross_entropy(module(x), y))
    opt.step()


def test_manual_optimization_is_refused(tmp_path):
    """Before, the watched module never stepped (its training_step, which steps, replaced)."""
    with pytest.raises(ConfigError, match="automatic_optimization=False"):
        _fit([WatchCallback(tmp_path / "w.parquet")], 1, _Stepped(_manual, manual=True), None)


def test_a_run_that_raises_leaves_the_module_as_it_was(tmp_path, monkeypatch):
    callback = WatchCallback(tmp_path / "w.parquet")

    def fails(*args, **kwargs):
        raise RuntimeError("in the step")

    monkeypatch.setattr(Watch, "step", fails)
    with pytest.raises(RuntimeError, match="in the step"):
        _fit([callback], 1)
    assert callback.watch is None  # closed, the module's training_step its own again


MODULE = """
import lightning.pytorch as pl
import torch
from torch import nn


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):  # the watch's step runs in its place, checked by it
        x, y, _ = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)


def plain():  # the model the module holds as ``net``, alone
    return Module().net
"""


def test_lightning_records_the_run_gradscope_train_records(tmp_path):
    """The run record written through the callback replays as ``gradscope train --record``'s
    of the same recipe, rows and order (the Trainer's clip read off it)."""
    from gradscope.config import load_config
    from gradscope.io.model import import_object
    from gradscope.training.replay import through_training
    from gradscope.training.run import train_model
    from tests.training.test_through_training import project

    (tmp_path / "lmodule.py").write_text(MODULE)
    train = {"optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01, "epochs": 2,
             "shuffle": False, "clip": 0.05}  # fmt: skip
    cfg = load_config(project(tmp_path, train, "lmodule.py:Module"))
    want = through_training(cfg, train_model(cfg, tmp_path / "out.pt", record=True).record,
                            tmp_path / "ref.pt", per_ref=True)  # fmt: skip
    data = torch.load(tmp_path / "data.pt")
    rows = torch.utils.data.TensorDataset(data["x"].double(), data["y"], torch.arange(10))
    trainer = pl.Trainer(
        max_epochs=2, gradient_clip_val=0.05, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        callbacks=[WatchCallback(tmp_path / "w.parquet", record=tmp_path / "l.run", segment=2)],
    )  # fmt: skip
    module = import_object(f"{tmp_path / 'lmodule.py'}:Module", "test")()
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=4))
    got = through_training(cfg, tmp_path / "l.run", tmp_path / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    # the model alone, its names the module's less ``net.``: the start's weights were loaded
    # as they were, and refused
    model = dataclasses.replace(cfg.model, factory=f"{tmp_path / 'lmodule.py'}:plain",
                                strip_prefix="net.")  # fmt: skip
    alone = through_training(dataclasses.replace(cfg, model=model), tmp_path / "l.run",
                             tmp_path / "ref.pt", per_ref=True)  # fmt: skip
    np.testing.assert_array_equal(alone, got)


def test_lightning_accumulation_is_refused_before_training(tmp_path):
    trainer = pl.Trainer(
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        max_epochs=1,
        callbacks=[WatchCallback(tmp_path / "w.parquet", record=tmp_path / "r")],
    )
    data = torch.utils.data.TensorDataset(torch.randn(4, 5).double(), torch.zeros(4).long(),
                                          torch.arange(4))  # fmt: skip
    with pytest.raises(ConfigError, match="not accumulated ones"):
        trainer.fit(_Module(), torch.utils.data.DataLoader(data, batch_size=2))
