"""A Hugging Face ``Trainer`` run and a Lightning fit, each watched with ``record=`` and dropout
on, stopped mid-run and resumed from the framework's own checkpoint: the resumed run's weights
equal those of the run that never stopped, bit for bit, and so does its record (the replay's
scores to 1e-12, in float64) and its watch file, the stopped run's continued; a resume the
record or the file cannot continue is one line saying what to do."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from gradscope.config import load_config
from gradscope.errors import ConfigError, DataError
from gradscope.training.replay import through_training
from gradscope.training.watch import Watch
from tests.training.test_through_training import project

GPT2 = {"vocab_size": 16, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
        "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "attn_implementation": "eager"}  # fmt: skip


def _stopped(monkeypatch, calls: int, error: type[BaseException]) -> None:
    """``Watch.step`` raises ``error`` at its call ``calls + 1``, as a run killed there."""
    step, made = Watch.step, []

    def stops(self, *args, **kwargs):
        made.append(1)
        if len(made) > calls:
            raise error("stopped")
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Watch, "step", stops)


def _refused(train, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as raised:
        train()
    assert "\n" not in str(raised.value)


def _same(model, other) -> None:
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)


def _same_rows(root, whole, resumed) -> None:
    """The resumed run's watch file holds the rows of the run that never stopped."""
    assert pq.read_table(root / resumed).to_pydict() == pq.read_table(root / whole).to_pydict()


def _same_replay(root, whole, resumed) -> None:
    cfg = load_config(root / "config.yaml")
    want = through_training(cfg, root / whole, root / "ref.pt", per_ref=True)  # (N, R)
    got = through_training(cfg, root / resumed, root / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_a_loop_resumed_goes_on_its_file_or_refuses_another(tmp_path):
    """A loop resumed at step 3 keeps the rows of ``out`` before it, drops the later ones and
    writes its own; a file without the steps before (or of another loss): one line, and the
    file as it was."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    out = tmp_path / "w.parquet"

    def run(step, steps, loss="cross_entropy", targets=y):
        with Watch(model, out, loss, step=step) as watch:
            for _ in range(steps):
                watch.step(x, targets, [7, 5, 3, 1]).backward()

    run(0, 5)
    first = pq.read_table(out).to_pydict()
    run(3, 1)
    table = pq.read_table(out).to_pydict()
    assert table["step"] == [s for s in range(4) for _ in range(4)]
    assert table["loss"][:12] == first["loss"][:12]
    assert table["example_id"][12:] == [7, 5, 3, 1]
    _refused(lambda: run(5, 1), "resumes at step 5, and out holds a watch file that is not the "
             "stopped run's steps 0-4")  # fmt: skip
    _refused(lambda: run(2, 1, "mse", torch.zeros(4, 2, dtype=torch.float64)), "steps 0-1")
    assert pq.read_table(out).to_pydict() == table
    assert [f.name for f in tmp_path.iterdir()] == ["w.parquet"]  # no temporary file left


def test_a_resumed_watch_touches_nothing_until_it_is_entered(tmp_path):
    """Made at step 2 over a stopped run's file and never entered, or entered with a record
    that refuses to start, or over a torn file: no temporary file, and ``out`` byte for byte
    as it was."""
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    out = tmp_path / "w.parquet"
    with Watch(model, out) as watch:
        for _ in range(3):
            watch.step(x, y, [0, 1, 2, 3]).backward()
    stopped = out.read_bytes()
    Watch(model, out, step=2)
    assert [f.name for f in tmp_path.iterdir()] == ["w.parquet"]
    record = tmp_path / "run"
    record.mkdir()
    (record / "notes.txt").write_text("")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.raises(ConfigError, match="no run record's folder"),
        Watch(model, out, step=2, record=record, optimizer=optimizer),
    ):
        pass
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run", "w.parquet"]
    assert out.read_bytes() == stopped
    torn = tmp_path / "torn.parquet"  # no Parquet file: one line, nothing left either
    torn.write_bytes(stopped[: len(stopped) // 2])
    with (
        pytest.raises(DataError, match="cannot read the stopped run's"),
        Watch(model, torn, step=2),
    ):
        pass
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run", "torn.parquet", "w.parquet"]


def _hf_project(root):
    """8 token rows of one length, their config (the replay's) and two reference rows."""
    datasets = pytest.importorskip("datasets")
    torch.manual_seed(0)
    tokens = torch.randint(0, 16, (8, 6))
    torch.save({"ids": tokens}, root / "data.pt")
    torch.save({"ids": torch.randint(0, 16, (2, 6))}, root / "ref.pt")
    config = {"model": {"factory": "transformers:GPT2LMHeadModel", "config": GPT2},
              "data": {"path": "data.pt", "inputs": "ids", "targets": "ids", "batch_size": 2},
              "loss": {"name": "causal_lm"}, "dtype": "float64", "device": "cpu"}  # fmt: skip
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    rows = {"input_ids": tokens.tolist(), "labels": tokens.tolist(), "example_id": list(range(8))}
    return datasets.Dataset.from_dict(rows)


def _hf_run(root, data, name, resume=None, save=False, accumulate=1):
    """Two epochs of four batches: the Trainer's AdamW, linear schedule and clip; a checkpoint
    after every step where ``save``, resumed from ``resume``; the record in NAME.run, or with
    ``accumulate`` batches a step none."""
    transformers = pytest.importorskip("transformers")
    from gradscope.training.watch_hf import WatchCallback

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).double()
    model.loss_type = "ForCausalLM"  # the mean over a step's tokens: the rows' mean
    args = transformers.TrainingArguments(
        str(root / "hf"), per_device_train_batch_size=2, num_train_epochs=2, learning_rate=1e-2,
        max_grad_norm=0.1, remove_unused_columns=False, report_to=[],
        save_strategy="steps" if save else "no", save_steps=1, logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0, gradient_accumulation_steps=accumulate,
    )  # fmt: skip
    record = root / f"{name}.run" if accumulate == 1 else None
    callback = WatchCallback(root / f"{name}.parquet", record=record, segment=2)
    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[callback])
    try:
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    finally:
        assert "forward" not in model.__dict__ and callback.watch is None
    return model


def test_a_trainer_resumed_from_its_checkpoint_continues_its_record(tmp_path, monkeypatch):
    """Stopped after 7 of 8 steps and resumed from ``checkpoint-6`` (mid-epoch): the Trainer
    skips the batches fed and restores the random state, and the watch's record and its file
    go on (the stopped run's step 6 dropped, taken again). From ``checkpoint-5`` (off the
    segments of 2) or without the optimizer's state: one line."""
    data = _hf_project(tmp_path)
    whole = _hf_run(tmp_path, data, "whole")
    with monkeypatch.context() as patch:
        _stopped(patch, 7, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            _hf_run(tmp_path, data, "w", save=True)
    saved = tmp_path / "hf"
    _refused(lambda: _hf_run(tmp_path, data, "w", saved / "checkpoint-5"),
             "holds the weights of none of its checkpoints: resume the loop from a checkpoint "
             "of its own taken after a multiple of segment=2")  # fmt: skip
    shutil.copytree(saved / "checkpoint-6", tmp_path / "weights-6")
    (tmp_path / "weights-6" / "optimizer.pt").unlink()
    _refused(lambda: _hf_run(tmp_path, data, "w", tmp_path / "weights-6"),
             "at step 6, and the optimizer not its state there: restore the optimizer")  # fmt: skip
    assert set(pq.read_table(tmp_path / "w.parquet")["step"].to_pylist()) == set(range(7))
    _same(_hf_run(tmp_path, data, "w", saved / "checkpoint-6"), whole)
    _same_rows(tmp_path, "whole.parquet", "w.parquet")
    _same_replay(tmp_path, "whole.run", "w.run")


def _numbered_on(root) -> None:
    """The resumed run's file numbers its rows (step, epoch) as the run that never stopped."""
    whole, resumed = (pq.read_table(root / f"{n}.parquet") for n in ("whole", "w"))
    for name in ("step", "epoch"):
        assert resumed[name].to_pylist() == whole[name].to_pylist()


def _refused_over_a_gap(root, resume, last: int) -> None:
    """``resume`` (the run resumed after step ``last``) over the stopped run's file with its
    step 1 taken out: one line as the watch is entered, no temporary file left; the file put
    back."""
    out = root / "w.parquet"
    stopped, table = out.read_bytes(), pq.read_table(out)
    pq.write_table(table.filter(pc.not_equal(table["step"], 1)), out)
    _refused(resume, f"not the stopped run's steps 0-{last}")
    assert not list(root.glob(".w.parquet*"))
    out.write_bytes(stopped)


def test_a_trainer_resumed_without_a_record_numbers_its_steps_on(tmp_path, monkeypatch):
    """Three batches a step (an epoch of four: steps of 3 and 1), stopped in the last batch and
    resumed from ``checkpoint-3``, mid-epoch: the file goes on from the 8th batch; over a file
    missing a step before, one line."""
    data = _hf_project(tmp_path)
    _hf_run(tmp_path, data, "whole", accumulate=3)
    with monkeypatch.context() as patch:
        _stopped(patch, 7, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            _hf_run(tmp_path, data, "w", save=True, accumulate=3)
    resume = tmp_path / "hf/checkpoint-3"
    _refused_over_a_gap(tmp_path, lambda: _hf_run(tmp_path, data, "w", resume, accumulate=3), 6)
    _hf_run(tmp_path, data, "w", resume, accumulate=3)
    _numbered_on(tmp_path)


def test_a_trainer_resumed_without_skipping_the_fed_batches_is_refused(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from gradscope.training.watch_hf import WatchCallback

    data = _hf_project(tmp_path)
    with monkeypatch.context() as patch:
        _stopped(patch, 2, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            _hf_run(tmp_path, data, "w", save=True)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).double()
    args = transformers.TrainingArguments(
        str(tmp_path / "hf"), per_device_train_batch_size=2, num_train_epochs=2,
        ignore_data_skip=True, remove_unused_columns=False, report_to=[], use_cpu=True,
    )  # fmt: skip
    callback = WatchCallback(tmp_path / "w.parquet", record=tmp_path / "w.run", segment=2)
    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[callback])
    _refused(lambda: trainer.train(resume_from_checkpoint=str(tmp_path / "hf/checkpoint-2")),
             "resumed at step 2, mid-epoch, with ignore_data_skip the Trainer feeds the epoch's "
             "first batches again")  # fmt: skip


MODULE = """
import lightning.pytorch as pl
import torch
from torch import nn


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.drop = nn.Linear(5, 8), nn.Linear(8, 3), nn.Dropout(0.3)
        self.double()

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))

    def training_step(self, batch, _):  # the watch's step runs in its place, checked by it
        x, y, _ = batch
        self.log("loss", loss := nn.functional.cross_entropy(self(x), y))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)
"""


def _fit(root, name, ckpt=None, every=None, stop=None, weights=None, accumulate=1):
    """Three epochs of 10 rows in shuffled batches of 4 (3 batches: 4, 4 and 2 rows) with
    dropout and a clip; a checkpoint every ``every`` steps, stopped as step ``stop`` begins,
    resumed from ``ckpt``, or begun from the ``weights`` of a checkpoint; the record in
    NAME.run, a segment every 2 steps, or with ``accumulate`` batches a step none."""
    pl = pytest.importorskip("lightning.pytorch")
    from gradscope.io.model import import_object
    from gradscope.training.watch_lightning import WatchCallback

    class Stop(pl.Callback):
        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == stop:
                raise InterruptedError

    record = root / f"{name}.run" if accumulate == 1 else None
    callbacks = [WatchCallback(root / f"{name}.parquet", record=record, segment=2)]
    if every is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(root / "ckpt", "{step}", save_top_k=-1,
                                                      every_n_train_steps=every))  # fmt: skip
    if stop is not None:
        callbacks.append(Stop())
    trainer = pl.Trainer(
        max_epochs=3, gradient_clip_val=0.5, callbacks=callbacks, logger=False,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=every is not None, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", default_root_dir=root,
    )  # fmt: skip
    module = import_object(f"{root / 'lmodule.py'}:Module", "test")()
    if weights is not None:
        module.load_state_dict(torch.load(weights, weights_only=False)["state_dict"])
    data = torch.load(root / "data.pt")
    rows = torch.utils.data.TensorDataset(data["x"].double(), data["y"], torch.arange(10))
    torch.manual_seed(1)  # the loader's order draws from torch's generator
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt)
    return module


def test_a_lightning_fit_resumed_at_an_epoch_end_continues_its_record(tmp_path):
    """Stopped after 7 of 9 steps and resumed from the checkpoint after step 6, an epoch's end:
    the callback restores the random state the checkpoint holds (Lightning restores none)
    before the epoch's order is drawn, and the record goes on. From a checkpoint mid-epoch
    (Lightning feeds that epoch from its start again), at an epoch's end off the segments
    (step 3), or with the weights alone: one line."""
    (tmp_path / "lmodule.py").write_text(MODULE)
    project(tmp_path, {"optimizer": "sgd", "lr": 0.1, "steps": 1}, "lmodule.py:Module")
    whole = _fit(tmp_path, "whole")
    with pytest.raises(InterruptedError):
        _fit(tmp_path, "w", every=1, stop=7)
    saved = tmp_path / "ckpt"
    _refused(
        lambda: _fit(tmp_path, "w", saved / "step=4.ckpt"),
        "resumed at step 4, mid-epoch, Lightning feeds the epoch from its first batch",
    )
    _refused(
        lambda: _fit(tmp_path, "w", saved / "step=3.ckpt"),
        "holds the weights of none of its checkpoints",
    )
    _refused(
        lambda: _fit(tmp_path, "w", weights=saved / "step=6.ckpt"),
        "at step 6, and the optimizer not its state there",
    )
    assert set(pq.read_table(tmp_path / "w.parquet")["step"].to_pylist()) == set(range(7))
    _same(_fit(tmp_path, "w", saved / "step=6.ckpt"), whole)
    _same_rows(tmp_path, "whole.parquet", "w.parquet")
    _same_replay(tmp_path, "whole.run", "w.run")


def test_a_lightning_fit_resumed_without_a_record_numbers_its_steps_on(tmp_path):
    """Two batches a step (an epoch of three: steps of 2 and 1), stopped as step 3 begins (the
    5th batch) and resumed from the checkpoint after step 2, an epoch's end: the file keeps
    the stopped run's first 3 batches and goes on from the 4th; over a file missing a step
    before, one line."""
    (tmp_path / "lmodule.py").write_text(MODULE)
    project(tmp_path, {"optimizer": "sgd", "lr": 0.1, "steps": 1}, "lmodule.py:Module")
    _fit(tmp_path, "whole", accumulate=2)
    with pytest.raises(InterruptedError):
        _fit(tmp_path, "w", every=1, stop=3, accumulate=2)
    assert pq.read_table(tmp_path / "w.parquet")["step"].to_pylist()[-1] == 4
    _refused_over_a_gap(
        tmp_path, lambda: _fit(tmp_path, "w", tmp_path / "ckpt" / "step=2.ckpt", accumulate=2), 2
    )
    _fit(tmp_path, "w", tmp_path / "ckpt" / "step=2.ckpt", accumulate=2)
    _numbered_on(tmp_path)
