"""``fit`` against training loops written out in the test, in float64: PyTorch's optimizers
stepped by hand, Hugging Face's schedules, the rows in the order a seeded generator draws."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from gradscope.config import TrainConfig, load_config
from gradscope.errors import ConfigError
from gradscope.io.model import import_object
from gradscope.training import fit
from gradscope.training.recipe import lr_factor
from tests.project import make_project

RECIPES = {
    "sgd": {"optimizer": "sgd", "lr": 0.3, "epochs": 3},
    "sgd-momentum-decay": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.9, "nesterov": True,
                           "weight_decay": 0.01, "steps": 11},
    "adam-linear-clip": {"optimizer": "adam", "lr": 0.05, "schedule": "linear", "warmup": 3,
                         "epochs": 2, "clip": 0.5},
    "adamw-cosine-warmup": {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1,
                            "schedule": "cosine", "warmup": 4, "epochs": 4, "batch_size": 5},
}  # fmt: skip
SCHEDULES = {
    "constant": get_constant_schedule_with_warmup,
    "linear": get_linear_schedule_with_warmup,
    "cosine": get_cosine_schedule_with_warmup,
}


def by_hand(
    root, train: dict, rows: np.ndarray, seed: int, weights: torch.Tensor | None = None
) -> torch.nn.Module:
    """The recipe as a plain loop: the factory's initialisation under the seed, a permutation
    of the rows per pass from a generator of the seed, the mean cross entropy (each row's loss
    times its weight, the divisor the batch's size), torch's optimizer, the learning rate
    Hugging Face's schedule gives each step."""
    recipe = TrainConfig(**train)
    torch.manual_seed(seed)
    model = import_object(f"{root / 'model.py'}:Net", "test")().double()
    data = torch.load(root / "data.pt")
    x, y = data["x"][rows].double(), data["y"][rows]
    w = torch.ones(len(rows), dtype=torch.float64) if weights is None else weights
    kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    kwargs = {"lr": recipe.lr, "weight_decay": recipe.weight_decay}
    if recipe.optimizer == "sgd":
        kwargs |= {"momentum": recipe.momentum, "nesterov": recipe.nesterov}
    opt = kinds[recipe.optimizer](model.parameters(), **kwargs)
    size = recipe.batch_size or 4
    per_pass = -(-len(rows) // size)
    total = recipe.steps or recipe.epochs * per_pass
    make = SCHEDULES[recipe.schedule]
    extra = {} if recipe.schedule == "constant" else {"num_training_steps": total}
    schedule = make(opt, num_warmup_steps=recipe.warmup, **extra)
    order, step = torch.Generator().manual_seed(seed), 0
    model.train()
    while step < total:
        for idx in torch.randperm(len(rows), generator=order).split(size):
            if step == total:
                break
            opt.zero_grad()
            losses = F.cross_entropy(model(x[idx]), y[idx], reduction="none")
            (losses * w[idx]).mean().backward()
            if recipe.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
            opt.step()
            schedule.step()
            step += 1
    return model


@pytest.mark.parametrize("name", RECIPES)
def test_fit_is_the_loop(tmp_path, name):
    config = make_project(tmp_path, n=17, train=RECIPES[name], dtype="float64")
    cfg = load_config(config)
    rows = np.array([0, 2, 3, 5, 8, 9, 10, 13, 14, 16])
    got = fit(cfg, rows, seed=7)
    want = by_hand(tmp_path, RECIPES[name], rows, 7)
    assert not got.training
    for (key, a), b in zip(got.state_dict().items(), want.state_dict().values(), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), key


@pytest.mark.parametrize("name", ["sgd-momentum-decay", "adamw-cosine-warmup"])
def test_weights_scale_each_rows_loss_in_the_same_order(tmp_path, name):
    """Weights keep every batch's rows and divisor: a weight of 0 takes a row's pull away
    without moving any other row to another batch; weights of 1 are no weights."""
    cfg = load_config(make_project(tmp_path, n=17, train=RECIPES[name], dtype="float64"))
    rows = np.arange(17)
    weights = torch.ones(17, dtype=torch.float64)
    weights[[2, 9]] = 0.0
    weights[5] = 1.5
    got = fit(cfg, rows, seed=3, weights=weights)
    want = by_hand(tmp_path, RECIPES[name], rows, 3, weights)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    ones, plain = fit(cfg, rows, seed=3, weights=np.ones(17)), fit(cfg, rows, seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip(ones.parameters(), plain.parameters(), strict=True)
    )


def test_bad_weights(tmp_path):
    cfg = load_config(make_project(tmp_path, train={}))
    with pytest.raises(ConfigError, match="23 finite numbers"):
        fit(cfg, weights=[1.0, 2.0])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedules_are_hugging_faces(schedule):
    recipe = TrainConfig(schedule=schedule, warmup=3, lr=1.0)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    extra = {} if schedule == "constant" else {"num_training_steps": 10}
    hf = SCHEDULES[schedule](opt, num_warmup_steps=3, **extra)
    for step in range(10):
        assert lr_factor(recipe, step, 10) == pytest.approx(hf.get_last_lr()[0], abs=1e-15)
        opt.step()
        hf.step()


def test_same_seed_same_weights_and_the_callers_random_state_kept(tmp_path):
    cfg = load_config(make_project(tmp_path, train={"lr": 0.1, "epochs": 2}))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = fit(cfg), fit(cfg), fit(cfg, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.fc1.weight, c.fc1.weight)


def test_rows_are_a_dataset_of_those_rows(tmp_path):
    """Training on rows of the data is training on a file that holds only those rows."""
    rows = np.array([1, 4, 6, 7, 11, 20])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = load_config(make_project(tmp_path / "a", train={"lr": 0.2, "epochs": 3}))
    data = torch.load(tmp_path / "a" / "data.pt")
    sub = load_config(make_project(tmp_path / "b", train={"lr": 0.2, "epochs": 3}))
    torch.save({k: v[rows] for k, v in data.items()}, tmp_path / "b" / "data.pt")
    got, want = fit(whole, rows), fit(sub)
    assert all(torch.equal(x, y) for x, y in zip(got.parameters(), want.parameters(), strict=True))


def test_init_starts_from_a_state_dict_and_the_checkpoint_is_not_read(tmp_path):
    config = make_project(tmp_path, train={"lr": 0.1, "steps": 1, "init": "net.pt"})
    (tmp_path / "gone.pt").write_bytes(b"")  # model.checkpoint: what training makes
    cfg = load_config(config)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, checkpoint="gone.pt"))
    model = fit(cfg)
    start = torch.load(tmp_path / "net.pt")
    moved = (model.fc1.weight - start["fc1.weight"]).abs().max()
    assert 0 < moved < 1


@pytest.mark.parametrize(
    ("rows", "message"),
    [([], "no rows to train on"), ([0, 0], "distinct positions"), ([23], "in 0..22")],
)
def test_bad_rows(tmp_path, rows, message):
    cfg = load_config(make_project(tmp_path, train={}))
    with pytest.raises(ConfigError, match=message):
        fit(cfg, rows)
