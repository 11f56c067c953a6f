"""The run record ``gradscope train --record`` writes, and its checks on reading: what a reverse
replay needs to retrace the run exactly, every file listed with its sha256 in a manifest written
last, so that a record edited, truncated or half-written is refused before anything replays.

A record folder holds ``segment-NNNNN.pt`` (the parameters, optimizer state and random state
as the step that begins the segment found them), ``steps.pt`` (each step's rows and learning
rate), ``final.pt`` (the trained parameters), ``record.json`` (the recipe, the fingerprint of the
config and files, how the run was made) and ``manifest.json``."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import Config, DataConfig
from ..errors import ConfigError, DataError, ModelError
from ..inputs import Inputs
from ..io.atomic import replace_atomically
from ..io.data import code_rows_key
from ..io.files import file_sha256
from ..resume import as_json, differences
from .loop import build, recipe
from .recordfiles import (
    FINAL,
    FORMAT,
    MANIFEST,
    META,
    STEPS,
    check_files,
    checked_steps,
    read_meta,
    refuse_foreign,
)
from .steps import Update

WATCHED = "watch"  # record.json's source when a watched loop wrote it (``watchrecord.py``)


def default_segment(total: int) -> int:
    """sqrt(T) steps per segment: sqrt(T) checkpoints on disk, and a replay holding sqrt(T)
    steps' weights and optimizer states in memory, the least of both together."""
    return max(1, math.isqrt(max(total, 1) - 1) + 1)


def record_key(cfg: Config, inputs: Inputs) -> dict:
    """What a replay must share with the run it replays: the model, data, loss, dtype and recipe
    (with the batch size resolved), the sha256 of every file training read (the code its
    factory imports from beside it too; and of the rows, where code makes them), and torch's
    version. Not where the model was written, nor how a later command batches its scoring,
    nor what does not change a step: the classes' names, the epoch checkpoints kept."""
    config = cfg.to_dict()
    train = dict(config["train"] or {}, batch_size=cfg.train.batch_size or cfg.data.batch_size)
    train.pop("save_every", None)  # epoch checkpoints written beside it: not the run's steps
    model = {k: v for k, v in config["model"].items() if k not in ("checkpoint", "checkpoints")}
    # the classes' names are the tables', not what is trained
    data = {k: v for k, v in config["data"].items() if k not in ("batch_size", "classes")}
    files = {
        file: file_sha256(file)
        for key, file in inputs
        if key not in ("config file", "report.tokenizer") and os.path.exists(file)
    }
    result = {"model": model, "data": data, "loss": config["loss"], "dtype": config["dtype"]}
    result |= {"train": train, "files": files, "torch": torch.__version__}
    return as_json(result | code_rows_key(cfg.data))  # no file above holds rows made by code


def rng() -> dict:
    """The random state now: the CPU generator's, and each GPU's once CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng(state: dict) -> None:
    """The random state a step of the run began with (what dropout draws from)."""
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _save(path: Path, value: object) -> None:
    replace_atomically(path, lambda f: torch.save(value, f), "the run record")


class Recorder:
    """Writes a run's record as it trains: a segment's checkpoint as its first step begins, each
    step's rows and learning rate, and at the end the rest and the manifest."""

    def __init__(self, folder: Path, segment: int, key: dict):
        self.folder, self.segment, self.key = folder, segment, key
        self.picked: list[Tensor] = []  # per step, (B,) positions among the training rows
        self.lrs: list[float] = []

    def start(self) -> None:
        """A fresh record: whatever an earlier one left in the folder goes."""
        if self.folder.exists():
            refuse_foreign(self.folder)
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)

    def state(self) -> dict:
        """The steps so far: every step's positions end to end, each step's count, its rate."""
        sizes = torch.tensor([len(p) for p in self.picked], dtype=torch.int64)
        picked = torch.cat(self.picked) if self.picked else torch.zeros(0, dtype=torch.int64)
        return {
            "picked": picked,
            "sizes": sizes,
            "lrs": torch.tensor(self.lrs, dtype=torch.float64),
        }

    def load(self, state: dict, steps: int) -> None:
        """What an interrupted run had recorded when its last pass was saved."""
        self.picked = list(state["picked"].split(state["sizes"].tolist()))[:steps]
        self.lrs = state["lrs"][:steps].tolist()

    def before_step(self, trainer, picked: Tensor) -> None:
        """Called as each step begins: its rows, its rate, and a checkpoint if it begins one."""
        if trainer.step % self.segment == 0:
            state = Update(trainer.train).state_of(trainer.optimizer, trainer.params)
            self.checkpoint(trainer.step, trainer.params, state)
        self.picked.append(picked.clone())
        self.lrs.append(trainer.lr_at(trainer.step))

    def checkpoint(self, step: int, params: list[Tensor], state: list[Tensor]) -> None:
        """The checkpoint of the segment that begins at ``step``: the weights and optimizer
        state as it found them, and the random state now."""
        checkpoint = {
            "step": step,
            "params": [p.detach().cpu().clone() for p in params],
            "state": [s.cpu() for s in state],
            "rng": rng(),
        }
        _save(self.folder / _segment_name(step // self.segment), checkpoint)

    def finish(self, trainer, buffers_change: bool) -> None:
        """The steps, the trained weights, the description and, last, the manifest."""
        self.write(trainer.params, trainer.rows.device, {"buffers_change": buffers_change})

    def write(self, params: list[Tensor], device: torch.device, meta: dict) -> None:
        """The end of a record: the steps, the trained ``params``, the description (``meta``
        and how the run was made) and, last, the manifest."""
        _save(self.folder / STEPS, self.state())
        _save(self.folder / FINAL, {"params": [p.detach().cpu() for p in params]})
        meta = {
            "format": FORMAT,
            "steps": len(self.lrs),
            "segment": self.segment,
            "key": self.key,
            "device": device.type,
            "deterministic": device.type == "cpu" or torch.are_deterministic_algorithms_enabled(),
        } | meta
        (self.folder / META).write_text(json.dumps(meta, indent=1))
        for stale in self.folder.glob(".*.tmp"):  # a write a kill cut short, before a resume
            stale.unlink()
        files = sorted(f.name for f in self.folder.iterdir() if f.name != MANIFEST)
        manifest = {name: file_sha256(self.folder / name) for name in files}
        (self.folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _segment_name(index: int) -> str:
    return f"segment-{index:05d}.pt"


@dataclass
class Record:
    """A run record that passed every check, its files read when asked."""

    folder: Path
    meta: dict
    update: Update
    clip: float | None  # the global norm each step's gradient was clipped to

    def start_model(self, cfg: Config) -> nn.Module:
        """The model as the run began, on the config's device and dtype: the recipe's
        initialisation, or the weights a watched loop began from."""
        if self.meta.get("source") == WATCHED:
            from .watched import watched_model

            return watched_model(self, cfg)
        return build(cfg, recipe(cfg).seed)

    @property
    def segments(self) -> int:
        return -(-self.meta["steps"] // self.meta["segment"])

    def bounds(self, k: int) -> tuple[int, int]:
        """The first step of segment ``k`` and the one after its last."""
        size = self.meta["segment"]
        return k * size, min((k + 1) * size, self.meta["steps"])

    def checkpoint(self, k: int) -> dict:
        return _load(self.folder / _segment_name(k))

    def steps(self, rows: int) -> tuple[list[Tensor], list[float]]:
        """Each step's (B,) positions among the ``rows`` training rows, and its learning rate;
        a file not of the record's steps is one line."""
        picked, sizes, lrs = checked_steps(_load(self.folder / STEPS), self.meta, rows, self.folder)
        return list(picked.split(sizes.tolist())), lrs.tolist()

    def drawn(self) -> dict[int, dict]:
        """Step -> the random state it began in, where the step before did not leave it (a
        watched loop that drew between steps); none for a run of ``gradscope train``."""
        if self.meta.get("source") != WATCHED:
            return {}
        from .watched import drawn

        return drawn(self)

    def check_rows(self, rows, data: DataConfig) -> None:
        """The rows the replay trains on (of the config's ``data``) are those a watched loop
        fed."""
        if self.meta.get("source") == WATCHED:
            from .watched import check_rows

            check_rows(self, rows, data)

    def final(self) -> list[Tensor]:
        return _load(self.folder / FINAL)["params"]

    def sha256(self) -> str:
        return file_sha256(self.folder / MANIFEST)


def _load(path: Path) -> dict:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        raise DataError(
            f"the run record's file does not read back ({type(e).__name__})", str(path)
        ) from e


def open_record(folder: str | Path, cfg: Config) -> Record:
    """The record in ``folder`` for a replay under ``cfg``, or one line naming why it cannot be
    replayed exactly: not a finished record, a file changed, another config or data, a loop
    gradscope did not run, an optimizer it does not know, a nondeterministic run."""
    folder = Path(folder).resolve()
    check_files(folder)
    meta = read_meta(folder)
    try:
        if meta.get("source") == WATCHED:
            from .watched import opened

            update, clip = opened(meta, cfg, folder)
        else:
            update, clip = _trained(meta, cfg, folder)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise DataError(
            f"the run record's {META} is not one gradscope wrote ({type(e).__name__}: {e})",
            str(folder),
        ) from e
    if not meta["deterministic"]:
        raise ConfigError(
            f"the run was recorded on {meta['device']} without "
            "torch.use_deterministic_algorithms(True): its steps cannot be replayed exactly",
            str(folder),
        )
    if meta["buffers_change"]:
        raise ModelError(
            "the model's buffers change as it trains (BatchNorm's running statistics): the "
            "replay differentiates through the weights only",
            str(folder),
        )
    return Record(folder, meta, update, clip)


def _trained(meta: dict, cfg: Config, folder: Path) -> tuple[Update, float | None]:
    """The update and clip of a ``gradscope train --record`` run: its config's recipe, which
    must be the record's, with the same files."""
    from .run import training_inputs

    if cfg.train is not None and cfg.train.fn is not None:
        raise ConfigError(
            "train.fn is a loop of your own: gradscope cannot replay it step by step", "train.fn"
        )
    changed = differences(meta["key"], record_key(cfg, training_inputs(cfg)))
    if changed:
        raise ConfigError(
            f"the run record was made with a different {', '.join(changed)}: replay it with the "
            "config and files that trained it",
            str(folder),
        )
    return Update(cfg.train), cfg.train.clip
