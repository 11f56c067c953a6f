"""The run record a watched loop writes (``Watch(record=...)``): a loop of the test's own, with
torch's optimizer and scheduler, replayed by ``through_training``, against the replay of
``gradscope train --record`` of the same recipe and data order, and against central finite
differences of retraining, in float64; what it cannot record, refused in one line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import ConfigError, RecordWarning
from gradscope.training.loop import TrainingRows, build
from gradscope.training.recipe import lr_factor, total_steps
from gradscope.training.replay import through_training
from gradscope.training.run import train_model
from gradscope.training.watch import Watch
from tests.project import edit_config, one_error
from tests.training.test_through_training import RECIPES, close, finite_differences, project
from tests.watch.test_watch import _LM

WATCHED = {
    "sgd-momentum-decay": RECIPES["sgd-momentum-decay"],
    "adamw-cosine-warmup-clip": RECIPES["adamw-cosine-warmup-clip"],
}


def optimizer_of(train, params) -> torch.optim.Optimizer:
    """The recipe's optimizer made as a user's loop makes it."""
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=train.lr,
            momentum=train.momentum,
            nesterov=train.nesterov,
            weight_decay=train.weight_decay,
        )
    return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), eps=train.eps,
                             weight_decay=train.weight_decay)  # fmt: skip


def watched_loop(cfg, folder: Path, step=None, make=optimizer_of, **watch) -> torch.nn.Module:
    """``gradscope train``'s run written as a user writes a loop: the same model, rows and
    order, torch's optimizer (``make(train, params)``) and a LambdaLR schedule, under the
    watch with ``record=``. ``step(watch, inputs, targets, picked)`` replaces the forward,
    backward and clip of a step; ``watch`` overrides ``Watch``'s arguments."""
    train = cfg.train
    rows = TrainingRows(cfg, None)
    model = build(cfg, train.seed).train()
    batch = train.batch_size or cfg.data.batch_size
    total = total_steps(train, len(rows), batch)
    optimizer = make(train, list(model.parameters()))
    schedule = LambdaLR(optimizer, lambda s: lr_factor(train, min(s, total - 1), total))
    order = torch.Generator().manual_seed(train.seed)
    options = {"record": folder, "optimizer": optimizer, "clip": train.clip, "segment": 3}
    with Watch(model, folder.with_suffix(".parquet"), **(options | watch)) as w:
        done = 0
        while done < total:
            for picked in torch.randperm(len(rows), generator=order).split(batch)[: total - done]:
                inputs, targets = rows.batch(picked)
                optimizer.zero_grad()
                if step is None:
                    w.step(inputs, targets, picked).backward()
                    if train.clip is not None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip)
                else:
                    step(w, inputs, targets, picked)
                optimizer.step()
                schedule.step()
                done += 1
    return model


@pytest.mark.parametrize("name", WATCHED)
def test_a_watched_loop_replays_as_gradscope_train(tmp_path, name):
    cfg = load_config(project(tmp_path, WATCHED[name]))
    trained = train_model(cfg, tmp_path / "out.pt", record=True, segment=3).record
    watched_loop(cfg, tmp_path / "watched.run")
    want = through_training(cfg, trained, tmp_path / "ref.pt", per_ref=True)  # (N, 3)
    got = through_training(cfg, tmp_path / "watched.run", tmp_path / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    assert close(got, finite_differences(cfg, tmp_path))
    edit_config(tmp_path, lambda raw: raw.pop("train"))  # a loop's config says no recipe
    alone = through_training(load_config(tmp_path / "config.yaml"), tmp_path / "watched.run",
                             tmp_path / "ref.pt", per_ref=True)  # fmt: skip
    np.testing.assert_array_equal(alone, got)


def _clipped(w, inputs, targets, picked):
    w.step(inputs, targets, picked).backward()
    torch.nn.utils.clip_grad_norm_(w.params, 0.05)


def _accumulated(w, inputs, targets, picked):
    for half in picked.chunk(2):
        rows = (picked[:, None] == half).any(1)  # (B,) the half's rows
        (w.step(tuple(t[rows] for t in inputs), targets[rows], half) / 2).backward()


def _autocast(w, inputs, targets, picked):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = w.step(inputs, targets, picked)
    loss.backward()


def _host_drawn(w, inputs, targets, picked):
    """A forward that draws from numpy's generator (a mask nothing reads)."""

    def draw(*_):
        np.random.rand()

    hook = w.model.register_forward_pre_hook(draw)
    try:
        w.step(inputs, targets, picked).backward()
    finally:
        hook.remove()


def _two_rates(train, params) -> torch.optim.Optimizer:
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": train.lr / 2}]
    return torch.optim.SGD(groups, lr=train.lr, momentum=train.momentum)


def _loss_nll(raw: dict) -> None:
    raw["loss"] = {"name": "nll"}


def _wider(raw: dict) -> None:
    raw["model"]["kwargs"] = {"hidden": 6}


def _float32(raw: dict) -> None:
    raw["dtype"] = "float32"


LOOPS = {  # a watched step, the optimizer, a config edit after the run; the line it gives
    "clipped without clip=": (_clipped, optimizer_of, None, "clipped without clip="),
    "accumulated": (_accumulated, optimizer_of, None, "two watched steps at step 0"),
    "a sum, not the mean": (lambda w, *batch: w.step(*batch, divisor=1.0).backward(),
                            optimizer_of, None, "the sum over 1, not the mean over its 4 rows"),
    "scaled": (lambda w, *batch: (w.step(*batch) * 1024).backward(), optimizer_of, None,
               "another gradient than the watched loss's at step 0"),
    "autocast": (_autocast, optimizer_of, None, "step 0 ran under autocast"),
    "host draws": (_host_drawn, optimizer_of, None, "step 0's forward drew from numpy's"),
    "two rates": (None, _two_rates, None, "learning rates differ at step 0"),
    "ids not positions": (lambda w, x, y, ids: w.step(x, y, ids + 100).backward(), optimizer_of,
                          None, "the watch's ids reach row 109, the config's data has 10 rows"),
    "other rows": (lambda w, x, y, ids: w.step(tuple(t + 0.01 for t in x), y, ids).backward(),
                   optimizer_of, None, "step 0 fed row 4 with other input 0 than"),
    "another loss": (None, optimizer_of, _loss_nll, "watched with a different loss.name"),
    "another model": (None, optimizer_of, _wider, "do not fit model.factory's model"),
    "another dtype": (None, optimizer_of, _float32, "trained in torch.float64, the config's "
                      "model is torch.float32"),
}  # fmt: skip


FOUND_AS_IT_TRAINS = {
    "clipped without clip=",
    "accumulated",
    "a sum, not the mean",
    "scaled",
    "autocast",
    "host draws",
    "two rates",
}  # the rest: by the replay alone


@pytest.mark.parametrize("case", LOOPS)
def test_what_the_replay_cannot_trust_is_one_line(tmp_path, case):
    """Refused by the replay in one line; what the run did otherwise told as it trained too,
    at the step it happened (a warning), what the replay alone finds not."""
    step, make, edit, message = LOOPS[case]
    config = project(tmp_path, WATCHED["sgd-momentum-decay"])
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always", RecordWarning)
        watched_loop(load_config(config), tmp_path / "w.run", step, make)
    told = [str(w.message) for w in told if w.category is RecordWarning]
    if case in FOUND_AS_IT_TRAINS:
        assert len(told) == 1 and message in told[0] and "will not replay" in told[0]
    else:
        assert not told
    if edit is not None:
        edit_config(tmp_path, edit)
    line = one_error(CliRunner().invoke(app, ["influence", str(config), "--ref",
        str(tmp_path / "ref.pt"), "--through-training", str(tmp_path / "w.run")]))  # fmt: skip
    assert message in line


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


BEFORE = {  # the optimizer of a model's four weights, Watch's arguments; the line refused
    "unknown optimizer": (lambda ps: torch.optim.RMSprop(ps), {}, "not RMSprop"),
    "groups that differ": (
        lambda ps: torch.optim.SGD([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:]}],
                                   lr=0.1), {}, "param groups differ in weight_decay"),
    "amsgrad": (lambda ps: torch.optim.Adam(ps, amsgrad=True), {}, "does not write out amsgrad"),
    "dampening": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1), {},
                  "does not write out dampening"),
    "part of the weights": (lambda ps: torch.optim.SGD(ps[:2], lr=0.1), {},
                            "the optimizer steps 2 tensors, the model trains 4"),
    "no optimizer": (lambda ps: None, {}, "record= needs the optimizer"),
    "a loss function": (lambda ps: torch.optim.SGD(ps, lr=0.1),
                        {"loss": lambda out, y: (out - y).square().sum(1)}, "the loss by name"),
    "a negative clip": (lambda ps: torch.optim.SGD(ps, lr=0.1), {"clip": -1.0}, "clip must be"),
}  # fmt: skip


@pytest.mark.parametrize("case", BEFORE)
def test_what_the_watch_cannot_record_is_refused_before_training(tmp_path, case):
    make, options, message = BEFORE[case]
    model = _net()
    optimizer = make(list(model.parameters()))
    with pytest.raises(ConfigError, match=message) as raised:
        Watch(model, tmp_path / "w.parquet", record=tmp_path / "w.run", optimizer=optimizer,
              **options)  # fmt: skip
    assert "\n" not in str(raised.value)


def test_a_stepped_optimizer_and_a_foreign_folder_are_refused(tmp_path):
    model = _net()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    with pytest.raises(ConfigError, match="stepped before the watch began"):
        Watch(model, tmp_path / "w.parquet", record=tmp_path / "w.run", optimizer=optimizer)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    watch = Watch(model, tmp_path / "w.parquet", record=tmp_path / "mine",
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    with pytest.raises(ConfigError, match="no run record's folder"):
        watch.__enter__()
    assert (tmp_path / "mine" / "notes.txt").exists()


@pytest.mark.parametrize(
    ("masked", "divisor", "refused"),
    [
        (False, None, None),
        (True, None, None),  # rows of different counts: the replay weighs each by its own
        (False, 24.0, "its tokens' losses over 24, not over the 20 tokens it counts"),
    ],
)
def test_a_token_mean_is_recorded_where_it_is_over_the_tokens(tmp_path, masked, divisor, refused):
    torch.manual_seed(0)
    model = _LM().double()
    tokens = torch.randint(0, 7, (4, 6))
    if masked:
        tokens[1, 3:] = -100
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(record=True) as told,
        Watch(model, tmp_path / "w.parquet", "causal_lm", reduction="tokens",
              record=tmp_path / "r", optimizer=optimizer) as watch,
    ):  # fmt: skip
        warnings.simplefilter("always", RecordWarning)
        optimizer.zero_grad()
        watch.step(tokens.clamp_min(0), tokens, torch.arange(4), divisor=divisor).backward()
        optimizer.step()
    assert [refused in str(w.message) for w in told] == ([] if refused is None else [True])
    meta = json.loads((tmp_path / "r" / "record.json").read_text())
    assert meta["refused"] is None if refused is None else refused in meta["refused"]
    assert meta["key"]["loss"]["name"] == "causal_lm" and meta["steps"] == 1 and meta["tokens"]


def _scaled_loop(cfg, folder: Path, scale: float | None, skip: int | None = None) -> None:
    """Eight steps of SGD with momentum, the loss scaled by a GradScaler of ``scale`` (None:
    none), which unscales the gradient before it steps; step ``skip`` not stepped, as a scaler
    skips a step of infinite gradients."""
    rows = TrainingRows(cfg, None)
    model = build(cfg, cfg.train.seed).train()
    optimizer = optimizer_of(cfg.train, list(model.parameters()))
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
    with Watch(model, folder.with_suffix(".parquet"), record=folder, optimizer=optimizer) as w:
        for step in range(8):
            picked = torch.arange(step * 4, step * 4 + 4) % 10
            optimizer.zero_grad()
            loss = w.step(*rows.batch(picked), picked)
            if scaler is None:
                loss.backward()
                if step != skip:
                    optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()


def test_a_loss_scaler_that_unscales_is_the_run_a_skipped_step_is_refused(tmp_path):
    cfg = load_config(project(tmp_path, WATCHED["sgd-momentum-decay"]))
    _scaled_loop(cfg, tmp_path / "plain.run", None)
    _scaled_loop(cfg, tmp_path / "scaled.run", 1024.0)
    want = through_training(cfg, tmp_path / "plain.run", tmp_path / "ref.pt")
    got = through_training(cfg, tmp_path / "scaled.run", tmp_path / "ref.pt")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    with pytest.warns(RecordWarning, match="two watched steps at step 3 without an optimizer"):
        _scaled_loop(cfg, tmp_path / "skipped.run", None, skip=3)
    with pytest.raises(ConfigError, match="two watched steps at step 3 without an optimizer"):
        through_training(cfg, tmp_path / "skipped.run", tmp_path / "ref.pt")
