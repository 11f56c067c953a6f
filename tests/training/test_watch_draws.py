"""A watched loop's record of what its steps drew and fed: dropout replayed mask for mask (against
the replay of ``gradscope train --record`` and central finite differences of retraining, in
float64), a loop that draws between its steps, the data each step fed checked at replay, and
the record of a loop stopped before its end, refused in one line that says what to do."""

from __future__ import annotations

import copy
import json

import numpy as np
import pyarrow.parquet as pq
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


def _loop(cfg, folder, stop=None, resume=None, saved=None) -> torch.nn.Module:
    """The recipe's loop under the watch as a user writes one that saves its own checkpoint
    (weights, optimizer, schedule, random state) into ``saved`` after every third step,
    stopped (KeyboardInterrupt) as step ``stop`` begins, or resumed from ``resume``."""
    train, rows = cfg.train, TrainingRows(cfg, None)
    model = build(cfg, train.seed).train()
    total = total_steps(train, len(rows), cfg.data.batch_size)
    optimizer = optimizer_of(train, list(model.parameters()))
    schedule = LambdaLR(optimizer, lambda s: lr_factor(train, min(s, total - 1), total))
    order = torch.Generator().manual_seed(train.seed)
    batches = [torch.randperm(N, generator=order)[:4] for _ in range(total)]
    first = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        schedule.load_state_dict(resume["schedule"])
        torch.set_rng_state(resume["rng"])
        first = resume["step"]
    with Watch(model, folder.with_suffix(f".{first}.parquet"), record=folder, optimizer=optimizer,
               clip=train.clip, segment=3) as w:  # fmt: skip
        for step in range(first, total):
            if step == stop:
                raise KeyboardInterrupt
            optimizer.zero_grad()
            w.step(*rows.batch(batches[step]), batches[step]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip)
            optimizer.step()
            schedule.step()
            if saved is not None and (step + 1) % 3 == 0:
                saved[step + 1] = copy.deepcopy({"model": model.state_dict(), "step": step + 1,
                    "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                    "rng": torch.get_rng_state()})  # fmt: skip
    return model


def test_a_loop_resumed_from_its_own_checkpoint_continues_its_record(tmp_path):
    """Stopped at step 6 of 7 and resumed from its checkpoint after step 6 (a segment of 3
    begins there), the loop writes the record of the run that never stopped: the replay
    through the CLI gives its scores; the half record alone is one line saying what to do."""
    config = project(tmp_path, RECIPE, "drop.py:Net")
    cfg = load_config(config)
    whole = _loop(cfg, tmp_path / "whole.run")
    saved = {}
    with pytest.raises(KeyboardInterrupt):
        _loop(cfg, tmp_path / "w.run", stop=6, saved=saved)
    line = _replay_line(config, tmp_path / "w.run")
    assert "resume the loop from a checkpoint of its own, or run it again" in line
    resumed = _loop(cfg, tmp_path / "w.run", resume=saved[6])
    for p, q in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q)
    out = tmp_path / "resumed.parquet"
    result = CliRunner().invoke(app, ["influence", str(config), "--ref", str(tmp_path / "ref.pt"),
        "--through-training", str(tmp_path / "w.run"), "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    want = through_training(cfg, tmp_path / "whole.run", tmp_path / "ref.pt")
    np.testing.assert_allclose(pq.read_table(out)["influence"].to_numpy(), want, rtol=1e-12)


def test_a_loop_resumed_otherwise_is_refused_as_the_watch_is_made(tmp_path):
    cfg = load_config(project(tmp_path, RECIPE, "drop.py:Net"))
    saved = {}
    with pytest.raises(KeyboardInterrupt):
        _loop(cfg, tmp_path / "w.run", stop=5, saved=saved)  # checkpoints after 3 steps, not 6
    model = build(cfg, cfg.train.seed)
    model.load_state_dict(saved[3]["model"])
    fresh = optimizer_of(cfg.train, list(model.parameters()))
    with pytest.raises(ConfigError, match="and the optimizer not its state there"):
        Watch(model, tmp_path / "x.parquet", record=tmp_path / "w.run", optimizer=fresh,
              clip=cfg.train.clip, segment=3)  # fmt: skip
    torch.nn.init.zeros_(model.fc1.bias)  # a checkpoint the record does not hold
    with pytest.raises(ConfigError, match="holds the weights of none of its checkpoints"):
        Watch(model, tmp_path / "x.parquet", record=tmp_path / "w.run", optimizer=fresh,
              clip=cfg.train.clip, segment=3)  # fmt: skip
    with pytest.raises(ConfigError, match="written with segment=3, not 2"):
        model.load_state_dict(saved[3]["model"])
        stepped = optimizer_of(cfg.train, list(model.parameters()))
        stepped.load_state_dict(saved[3]["optimizer"])
        Watch(model, tmp_path / "x.parquet", record=tmp_path / "w.run", optimizer=stepped,
              clip=cfg.train.clip, segment=2)  # fmt: skip


def test_a_record_written_before_the_watch_kept_digests_still_replays(tmp_path):
    """A record of the last version (no watched.pt: no draws, which the watch refused then,
    and no digests) replays as before, by its segments' check alone."""
    cfg = load_config(project(tmp_path, RECIPES["sgd-momentum-decay"]))
    watched_loop(cfg, tmp_path / "w.run")
    want = through_training(cfg, tmp_path / "w.run", tmp_path / "ref.pt")
    (tmp_path / "w.run" / "watched.pt").unlink()
    manifest = json.loads((tmp_path / "w.run" / "manifest.json").read_text())
    del manifest["watched.pt"]
    (tmp_path / "w.run" / "manifest.json").write_text(json.dumps(manifest))
    np.testing.assert_array_equal(through_training(cfg, tmp_path / "w.run", tmp_path / "ref.pt"),
                                  want)  # fmt: skip
