"""``gradscope train``: the recipe run once, its checkpoint (and epoch checkpoints) written
whole or not at all, the output locked, and an interrupted run resumed from its last pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import distributed
from ..config import Config
from ..errors import ConfigError, DataError, Interrupted
from ..inputs import Inputs, check_output, run_inputs
from ..io.atomic import replace_atomically
from ..io.code import code_files
from ..io.data import code_file, code_rows_key
from ..io.lock import OutputLock
from ..io.parquet import PartialRun
from ..job import resolve_device
from ..resume import fingerprint, refuse_unresumed, resumed_parts
from .loop import Trainer, TrainingRows, build, recipe
from .recipe import check_warmup, total_rows
from .record import Recorder, default_segment, record_key
from .recordfiles import refuse_foreign
from .user import run_user_fn

STATE = "state.pt"


@dataclass
class Trained:
    """What a run wrote: the checkpoint, and each epoch checkpoint with its pass's learning rate
    (a TracIn weight), beside the run's size and its last pass's mean training loss, and the run
    record's folder."""

    path: Path
    epochs: list[tuple[Path, float]]
    rows: int
    steps: int
    loss: float
    record: Path | None = None  # the run record's folder, with --record


def output(cfg: Config, out: str | Path | None) -> Path:
    """``--out``, else the ``model.checkpoint`` the config scores."""
    if out is None and cfg.model.checkpoint is None:
        raise ConfigError("nowhere to write the model: give --out or set model.checkpoint", "--out")
    return Path(out if out is not None else cfg.model.checkpoint).resolve()


def epoch_path(path: Path, epoch: int) -> Path:
    """``model.epoch3.pt`` beside ``model.pt``."""
    return path.with_name(f"{path.stem}.epoch{epoch}{path.suffix}")


def training_inputs(cfg: Config) -> Inputs:
    """What training reads: the config's files but ``model.checkpoint`` (what it writes),
    ``train.init``, ``train.fn``'s file, and the Python files its code imports from beside it
    (a record of the run replays only while they are as they were)."""
    train = recipe(cfg)
    model = dataclasses.replace(cfg.model, checkpoint=None, checkpoints=[])
    more = [("train.init", train.init)] if train.init else []
    if train.fn and code_file(train.fn):
        more.append(("train.fn", code_file(train.fn)))
    more += [(f"code {name}", path) for name, path in code_files(cfg).items()]
    return run_inputs(dataclasses.replace(cfg, model=model), more)


def save(model: torch.nn.Module, path: Path) -> None:
    """The model's state dict on the CPU, as safetensors or ``torch.save`` by the suffix, under a
    temporary name renamed into place when whole."""
    state = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save as to_bytes

        data = to_bytes(state)
        replace_atomically(path, lambda f: f.write(data), "the checkpoint")
    else:
        replace_atomically(path, lambda f: torch.save(state, f), "the checkpoint")


def train_model(
    cfg: Config,
    out: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    record: bool = False,
    segment: int | None = None,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Trained:
    """Train by ``cfg.train`` on every row and write the checkpoint to ``out`` (default
    ``model.checkpoint``), and every ``train.save_every`` epochs an epoch checkpoint beside it.

    Before anything trains, the outputs are checked against every input, a checkpoint already
    there is refused without ``overwrite``, and the output is locked. After each pass the state
    (weights, optimizer, step, random states) is saved in the partial folder: ``resume``
    continues an interrupted run of the same config and files exactly as it would have gone.
    ``record`` also writes the run record a reverse replay needs (``record.py``) in the folder
    ``NAME.run`` beside the checkpoint, a checkpoint every ``segment`` steps (default sqrt(T)).
    """
    train = recipe(cfg)
    path = output(cfg, out)
    inputs = training_inputs(cfg)
    folder = record_path(path) if record else None
    _refuse(cfg, path, folder, inputs, overwrite or resume, segment)
    with OutputLock(path):
        # a record's segment by name: None (its default) is not "no record"
        extra = {"out": str(path), "record": {"segment": segment} if record else None}
        extra |= code_rows_key(cfg.data)  # no file holds rows made by code
        key = fingerprint(cfg, "train", inputs, extra, resolve_device(cfg.device).type)
        run = PartialRun(path, key)
        run.refuse_foreign()
        state = _resumed(run, key) if resume else _unresumed(run, key, overwrite)
        with torch.random.fork_rng(devices=[]):
            rows = TrainingRows(cfg, None)
            model = build(cfg, train.seed)
            if train.fn is not None:
                save(run_user_fn(train.fn, model, rows.positions, train.seed), path)
                return Trained(path, [], len(rows), 0, float("nan"))
            trainer = Trainer(cfg, model, rows, train.seed, on_batch)
            check_warmup(train, len(rows), trainer.batch_size)
            _refuse_epochs(trainer, path, inputs, overwrite or resume)
            recorder = _recorder(cfg, trainer, folder, segment, inputs)
            _begin(run, trainer, recorder, state)
            if on_start:
                on_start(total_rows(train, len(rows), trainer.batch_size))
                if on_batch and trainer.step:
                    on_batch(_done_rows(trainer))
            buffers = [b.detach().clone() for b in model.buffers()]
            epochs = _train(trainer, run, path, recorder)
            if recorder:
                changed = any(
                    not torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True)
                )
                recorder.finish(trainer, changed)
        save(model, path)
        run.finish()
    return Trained(path, epochs, len(rows), trainer.step, trainer.last_loss, folder)


def _begin(run: PartialRun, trainer: Trainer, recorder, state: dict | None) -> None:
    """A new run started, or a resumed one's trainer (and record) where it stopped."""
    if state is None:
        run.start()
        if recorder:
            recorder.start()
        return
    trainer.load(state)
    if recorder:
        recorder.load(state["record"], trainer.step)


def _refuse(
    cfg: Config,
    path: Path,
    folder: Path | None,
    inputs: Inputs,
    replacing: bool,
    segment: int | None,
) -> None:
    """What ``train_model`` refuses before anything trains: torchrun, an output that is an
    input or its own run record's folder, a checkpoint or run record there already (without
    --overwrite or --resume), a segment of no steps, a record of a loop of the user's own."""
    distributed.one_process("gradscope train", "train")
    check_output(path, inputs, option="--out or model.checkpoint")
    if folder is not None and folder == path:
        raise ConfigError(
            "the checkpoint would be its own run record's folder (--record writes NAME.run "
            "beside NAME.pt): name the checkpoint .pt or .safetensors",
            str(path),
        )
    if path.exists() and not replacing:
        raise ConfigError(
            "a checkpoint is there already; pass --overwrite to replace it, or --out", str(path)
        )
    if folder is not None and folder.exists() and not replacing:
        raise ConfigError(
            "a run record is there already; pass --overwrite to replace it, or --out", str(folder)
        )
    if folder is not None and folder.exists():
        refuse_foreign(folder)
    if segment is not None and segment < 1:
        raise ConfigError("--segment must be a positive number of steps", "--segment")
    if segment is not None and folder is None:
        raise ConfigError("--segment sets a run record's segments: pass --record too", "--segment")
    if folder is not None and cfg.train.fn is not None:
        raise ConfigError("train.fn is a loop of your own: gradscope cannot record it", "train.fn")


def _saved_epochs(trainer: Trainer) -> list[int]:
    """The passes after which ``train.save_every`` writes an epoch checkpoint: every
    ``save_every``-th but the last (whose weights are the checkpoint itself)."""
    every, per_pass = trainer.train.save_every, -(-len(trainer.rows) // trainer.batch_size)
    return list(range(every, -(-trainer.total // per_pass), every)) if every else []


def _refuse_epochs(trainer: Trainer, path: Path, inputs: Inputs, replacing: bool) -> None:
    """The epoch checkpoints ``train.save_every`` will write, as the checkpoint is: none an
    input (the data, the factory, ``train.init``), none there already unless ``replacing``
    (they were written over whatever lay there, the data file too)."""
    for epoch in _saved_epochs(trainer):
        at = epoch_path(path, epoch)
        check_output(at, inputs, option="--out or model.checkpoint")
        if at.exists() and not replacing:
            raise ConfigError(
                "an epoch checkpoint is there already; pass --overwrite to replace it, or --out",
                str(at),
            )


def _done_rows(trainer: Trainer) -> int:
    return total_rows(
        dataclasses.replace(trainer.train, steps=trainer.step, epochs=None),
        len(trainer.rows),
        trainer.batch_size,
    )


def _resumed(run: PartialRun, key: dict) -> dict | None:
    """The state an interrupted run of the same fingerprint saved after its last pass (None when
    it was interrupted in its first)."""
    resumed_parts(run, key)  # refuses no run, or another run's
    file = run.dir / STATE
    if not file.is_file():
        return None
    try:
        return torch.load(file, weights_only=True)
    except Exception as e:  # a damaged file: start over rather than guess
        raise DataError(
            f"the interrupted run's {STATE} does not read back ({type(e).__name__}); run "
            "without --resume to start over",
            str(file),
        ) from e


def _unresumed(run: PartialRun, key: dict, overwrite: bool) -> None:
    """No state to start from: an interrupted run of the same fingerprint that saved its state
    is refused, not thrown away, unless ``overwrite`` says to start over."""
    if not overwrite:  # hours of training, kept unless told
        saved = "its training state" if (run.dir / STATE).is_file() else None
        refuse_unresumed(run, key, saved, "pass --overwrite")


def record_path(path: Path) -> Path:
    """``model.run/`` beside ``model.pt``: where ``--record`` writes the run record."""
    return path.with_name(f"{path.stem}.run")


def _recorder(
    cfg: Config, trainer: Trainer, folder: Path | None, segment: int | None, inputs: Inputs
) -> Recorder | None:
    """The recorder of a ``--record`` run, hooked to each step's start."""
    if folder is None:
        return None
    recorder = Recorder(folder, segment or default_segment(trainer.total), record_key(cfg, inputs))
    trainer.before_step = recorder.before_step
    return recorder


def _train(
    trainer: Trainer, run: PartialRun, path: Path, recorder: Recorder | None
) -> list[tuple[Path, float]]:
    """Every pass; after each, the state saved and, every ``save_every`` passes but the last,
    the epoch checkpoint written. Ctrl-C keeps what the last whole pass saved. Returns the
    checkpoints of a TracIn sum (the epoch ones, then the final one), each with the mean
    learning rate of the steps since the one before (its TracIn weight)."""
    saved = _saved_epochs(trainer)
    try:
        for epoch in trainer.epochs():
            if epoch in saved:
                save(trainer.model, epoch_path(path, epoch))
            state = trainer.state()
            _save_state(state | {"record": recorder.state()} if recorder else state, run)
    except KeyboardInterrupt:
        if trainer.epoch == 0:  # not "before any example was saved": training saves no example
            raise Interrupted("interrupted in the first epoch, nothing saved", str(path)) from None
        raise Interrupted(
            f"interrupted after epoch {trainer.epoch}; run the same command with --resume to "
            "continue from there",
            str(run.dir),
        ) from None
    if not trainer.train.save_every:
        return []
    per_pass = -(-len(trainer.rows) // trainer.batch_size)
    ends = [(epoch_path(path, e), e * per_pass) for e in saved] + [(path, trainer.total)]
    starts = [0] + [end for _, end in ends[:-1]]
    return [(file, sum(map(trainer.lr_at, range(lo, hi))) / (hi - lo))
            for (file, hi), lo in zip(ends, starts, strict=True)]  # fmt: skip


def _save_state(state: dict, run: PartialRun) -> None:
    replace_atomically(run.dir / STATE, lambda f: torch.save(state, f), "the training state")
