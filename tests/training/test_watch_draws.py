"""A watched loop's record of what its steps drew and fed: dropout replayed mask for mask (against
the replay of ``gradscope train --record`` and central finite differences of retraining, in
float64), a loop that draws between its steps, the data each step fed checked at replay, and
the record of a loop stopped before its end, refused in one line that says what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.config import load_config
from gradscope.errors import ConfigError
from gradscope.training.loop import TrainingRows, build
from gradscope.training.recipe import lr_factor, total_steps
from gradscope.training.replay import through_training
from gradscope.training.run import train_model
from gradscope.training.watch import Watch
from tests.project import one_error
from tests.training.test_through_training import RECIPES, N, close, finite_differences, project
from tests.training.test_watch_record import optimizer_of, watched_loop

RECIPE = RECIPES["adamw-cosine-warmup-clip"]


def _replay_line(config, run) -> str:
    return one_error(CliRunner().invoke(app, ["influence", str(config), "--ref",
        str(config.parent / "ref.pt"), "--through-training", str(run)]))  # fmt: skip


def test_dropout_under_the_watch_replays_as_gradscope_train(tmp_path):
    """The watched loop draws the masks ``gradscope train`` draws (each step leaves the
    generator where one forward does), and the replay redraws them."""
    cfg = load_config(project(tmp_path, RECIPE, "drop.py:Net"))
    trained = train_model(cfg, tmp_path / "out.pt", record=True, segment=3)
    model = watched_loop(cfg, tmp_path / "watched.run")
    for p, q in zip(model.parameters(), torch.load(tmp_path / "out.pt").values(), strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=1e-12, atol=1e-14)
    want = through_training(cfg, trained.record, tmp_path / "ref.pt", per_ref=True)  # (N, 3)
    got = through_training(cfg, tmp_path / "watched.run", tmp_path / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
    assert close(got, finite_differences(cfg, tmp_path))


def _drawing_loop(cfg, weights: torch.Tensor | None = None, folder=None) -> torch.nn.Module:
    """The recipe's loop with a random draw before each step (as a loader's shuffle draws),
    on the rows' losses times ``weights``, or under the watch recording into ``folder``."""
    train, rows = cfg.train, TrainingRows(cfg, None)
    model = build(cfg, train.seed).train()
    total = total_steps(train, len(rows), cfg.data.batch_size)
    optimizer = optimizer_of(train, list(model.parameters()))
    schedule = LambdaLR(optimizer, lambda s: lr_factor(train, min(s, total - 1), total))
    watch = None
    if folder is not None:
        watch = Watch(model, folder.with_suffix(".parquet"), record=folder, optimizer=optimizer,
                      clip=train.clip, segment=3).__enter__()  # fmt: skip
    for _ in range(total):
        picked = torch.randperm(N)[: cfg.data.batch_size]  # from torch's generator
        inputs, targets = rows.batch(picked)
        optimizer.zero_grad()
        if watch is None:
            losses = F.cross_entropy(model(*inputs), targets, reduction="none")
            (losses * weights[picked]).mean().backward()
        else:
            watch.step(inputs, targets, picked).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip)
        optimizer.step()
        schedule.step()
    if watch is not None:
        watch.__exit__(None, None, None)
    return model


def test_a_loop_that_draws_between_steps_replays_its_masks(tmp_path):
    cfg = load_config(project(tmp_path, RECIPE, "drop.py:Net"))
    watched = _drawing_loop(cfg, folder=tmp_path / "w.run")
    plain = _drawing_loop(cfg, torch.ones(N, dtype=torch.float64))
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    got = through_training(cfg, tmp_path / "w.run", tmp_path / "ref.pt", per_ref=True)
    ref = torch.load(tmp_path / "ref.pt")

    def losses(weights: torch.Tensor) -> np.ndarray:  # (3,) after the loop with the weights
        out = _drawing_loop(cfg, weights).eval()(ref["x"].double())
        return F.cross_entropy(out, ref["y"], reduction="none").detach().numpy()

    eps, want = 1e-5, []
    for i in range(N):
        e = torch.zeros(N, dtype=torch.float64)
        e[i] = eps
        want.append(-(losses(1 + e) - losses(1 - e)) / (2 * eps))
    assert close(got, np.stack(want))


def test_a_row_edited_after_the_run_is_one_line_naming_the_data(tmp_path):
    config = project(tmp_path, RECIPES["sgd-momentum-decay"])
    watched_loop(load_config(config), tmp_path / "w.run")
    data = torch.load(tmp_path / "data.pt")
    data["y"][7] = (data["y"][7] + 1) % 3
    torch.save(data, tmp_path / "data.pt")
    line = _replay_line(config, tmp_path / "w.run")
    assert "fed row 7 with other targets than" in line and "data.pt holds" in line


def _stopped(w, inputs, targets, picked):
    if w.steps == 4:
        raise KeyboardInterrupt
    w.step(inputs, targets, picked).backward()


def test_a_loop_stopped_before_its_end_is_run_again_from_its_first_step(tmp_path):
    config = project(tmp_path, RECIPES["sgd-momentum-decay"])
    cfg = load_config(config)
    with pytest.raises(KeyboardInterrupt):
        watched_loop(cfg, tmp_path / "w.run", _stopped)
    line = _replay_line(config, tmp_path / "w.run")
    assert "cannot be continued; run the loop again from its first step" in line
    resumed = build(cfg, cfg.train.seed)  # the loop's own checkpoint: other weights
    torch.nn.init.zeros_(resumed.fc1.bias)
    with pytest.raises(ConfigError, match="cannot be continued from a checkpoint of the loop"):
        Watch(resumed, tmp_path / "w.parquet", record=tmp_path / "w.run",
              optimizer=torch.optim.SGD(resumed.parameters(), lr=0.1))  # fmt: skip
    watched_loop(cfg, tmp_path / "w.run")  # from its first step: written over, and replayed
    watched_loop(cfg, tmp_path / "again.run")
    got = through_training(cfg, tmp_path / "w.run", tmp_path / "ref.pt")
    np.testing.assert_array_equal(got, through_training(cfg, tmp_path / "again.run",
                                                        tmp_path / "ref.pt"))  # fmt: skip
