"""``influence --through-training RUN``: the scores of the reverse replay written as ``influence``
writes its own, one row per training example (or per example and reference), with the loss at
the run's trained weights."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import distributed
from ..config import Config
from ..defaults import CG_TOLERANCE
from ..errors import ConfigError, DataError, GradscopeError
from ..inputs import data_inputs, run_inputs
from ..io.data import Batch, code_rows_sha256, data_identity
from ..io.lock import OutputLock
from ..job import Job, config_forward, config_loss
from ..scorers.base import (
    Inputs,
    Scorer,
    all_finite,
    counted,
    leading,
    leading_names,
    trailing_names,
)
from .record import Record, open_record
from .recordfiles import read_meta
from .replay import through_training

METHOD = "through-training"


class ThroughTrainingScorer(Scorer):
    """Each training row's through-training score for REF; ``replay`` runs before the scoring
    run, which then writes the rows. A killed replay continues from the folder
    ``.NAME.replay`` beside the output; the folder goes once the file is written."""

    command = "influence"

    def __init__(self, ref: str | Path, run: str | Path, *, per_ref: bool = False):
        super().__init__()
        ref = str(ref)
        self.ref = ref if ".py:" in ref else str(Path(ref).resolve())
        self.run, self.per_ref = str(Path(run).resolve()), per_ref
        self.scores: np.ndarray | None = None  # (N, R)
        self.folder: Path | None = None
        self._model: torch.nn.Module | None = None
        self.record: Record | None = None
        self.trained: Config | None = None  # the config the run trained by

    def replay(
        self, cfg: Config, on_start: Callable[[int], None], on_step: Callable[[int], None]
    ) -> None:
        """The reverse replay of the run for REF (refused under torchrun: one process). ``cfg``
        is the config the run trained by: a scoring run's ``--limit`` and ``--batch-size`` only
        choose which of its rows the file shows, and how they are batched."""
        distributed.one_process("--through-training", "--through-training")
        out = Path(cfg.output.path)
        self.folder = replay_folder(out)
        started = time.perf_counter()
        scores = through_training(
            cfg,
            self.run,
            self.ref,
            per_ref=self.per_ref,
            partial=self.folder,
            on_start=on_start,
            on_step=on_step,
        )
        self.scores = scores if self.per_ref else scores[:, None]
        self.trained = cfg
        self.seconds_before = time.perf_counter() - started

    def __exit__(self, kind, *exc) -> None:
        super().__exit__(kind, *exc)
        if kind is None and self.folder is not None:  # the file is written
            shutil.rmtree(self.folder, ignore_errors=True)

    def reads(self) -> Inputs:
        return data_inputs("--ref", self.ref) + [("--through-training", self.run)]

    def resume_key(self, cfg: Config) -> dict:
        ref = {"ref": self.ref, "ref made by code": code_rows_sha256(cfg.data, self.ref)}
        return ref | {"per_ref": self.per_ref, "through_training": self.run}

    def names(self, cfg: Config) -> list[str]:
        ref_id = ["ref_id"] if self.per_ref else []
        return [*leading_names(cfg), *ref_id, "loss", "influence", *trailing_names(cfg)]

    def setup(self, job: Job) -> None:
        """The model at the run's trained weights, for each row's loss."""
        cfg = self.trained
        record = open_record(self.run, cfg)
        with torch.random.fork_rng(devices=[]):
            model = record.start_model(cfg)
        trained = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, value in zip(trained, record.final(), strict=True):
                p.copy_(value)
        self._model = model.eval()
        self.record = record

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        inputs, targets = job.to_device(batch)
        with torch.no_grad():
            output = config_forward(job.cfg)(self._model, inputs)
            (loss,) = counted(job, batch, [config_loss(job.cfg)(output, targets)])
        rows = len(self.scores)
        if batch.index.max() >= rows:  # a --limit past the config's own data.limit
            raise DataError(f"the run trained on {rows} rows; --limit asks for more", "--limit")
        scores = self.scores[batch.index.numpy()]  # (B, R)
        b, r = scores.shape
        columns = {name: np.repeat(v, r, axis=0) for name, v in leading(batch).items()}
        if self.per_ref:
            columns["ref_id"] = np.tile(np.arange(r, dtype=np.int64), b)
        columns["loss"] = np.repeat(loss.numpy(), r)
        columns["influence"] = scores.reshape(-1)
        if batch.targets.dim() == 1:
            columns["target"] = np.repeat(batch.targets.numpy(), r)
        finite = all_finite(loss)[:, None].numpy() & np.isfinite(scores)  # (B, R)
        columns["finite"] = finite.reshape(-1)
        return columns

    def metadata(self) -> dict:
        meta = self.record.meta
        return {
            "influence": {
                "method": METHOD,
                "run": self.run,
                "run_sha256": self.record.sha256(),
                "steps": meta["steps"],
                "segment": meta["segment"],
                "ref": self.ref,
                "ref_sha256": data_identity(self.trained.data, self.ref),
                "per_ref": self.per_ref,
            }
        }


def unread(
    curvature: object, precondition: object, damping: object, solver: str, tolerance: float,
    engine: str, cli: bool = True,
) -> dict[str, bool]:  # fmt: skip
    """Which of influence's options beside ``--through-training`` were set, by the command's
    names (``cli``) or the API's: ``replayed`` refuses them."""
    given = {"curvature": curvature is not None, "precondition": precondition is not None,
             "damping": damping is not None, "solver": solver != "auto",
             "cg-tolerance": tolerance != CG_TOLERANCE, "engine": engine != "auto"}  # fmt: skip
    return {(f"--{k}" if cli else k.replace("-", "_")): v for k, v in given.items()}


def at_record(cfg: Config) -> Config:
    """The config of a through-training scoring run: its rows are scored at the record's last
    weights (``ThroughTrainingScorer.setup``), so neither ``model.checkpoint`` nor
    ``model.checkpoints`` is read, checked or named in the file."""
    model = dataclasses.replace(cfg.model, checkpoint=None, checkpoints=[])
    return dataclasses.replace(cfg, model=model)


def as_recorded(cfg: Config, run: Path, keys: set[str]) -> Config:
    """``cfg`` with the API's ``limit`` and ``batch_size`` among ``keys`` as the ``gradscope
    train`` run recorded at ``run`` had them (its ``data.limit``; its batch, where
    ``train.batch_size`` leaves it to ``data.batch_size``): in an influence call they choose
    the rows scored, and a replay trains on the rows the run did. ``cfg`` as it is where the
    record gives neither (a watched run's, or one that does not read back: the replay says)."""
    try:
        key = read_meta(Path(run).resolve())["key"]
        limit, batch = key["data"]["limit"], key["train"]["batch_size"]
    except (GradscopeError, OSError, KeyError, TypeError):
        return cfg
    data = cfg.data
    if "limit" in keys and (limit is None or type(limit) is int):
        data = dataclasses.replace(data, limit=limit)
    if (
        "batch_size" in keys
        and type(batch) is int
        and (cfg.train is None or not cfg.train.batch_size)
    ):
        data = dataclasses.replace(data, batch_size=batch)
    return dataclasses.replace(cfg, data=data)


def replay_folder(out: Path) -> Path:
    """Where the replay for the output ``out`` saves its progress: ``.NAME.replay`` beside it."""
    return out.with_name(f".{out.name}.replay")


def replayed(
    cfg: Config, ref: str, run: Path, per_ref: bool, given: dict[str, bool], resume: bool = False
) -> ThroughTrainingScorer:
    """``influence --through-training RUN``'s scorer, its replay run under a progress bar in
    steps; ``given`` says which of influence's other options were set (``--curvature``,
    ``--precondition``, ``--damping``, ...): each is refused, the replay is the exact answer for
    the run, no curvature stands in for it and no engine runs it. A killed replay continues from
    its folder whether or not ``resume`` asks it to; ``resume`` with none there is refused
    before the replay, not after it. (The rows' file after it is written afresh: its scoring
    run is not resumed.)"""
    from .. import terminal

    unread = [name for name, set_ in given.items() if set_]
    if unread:
        raise ConfigError(
            f"--through-training replays the run itself: it reads no {unread[0]} (no curvature "
            "stands in for the run, and no engine option applies)",
            unread[0],
        )
    out = Path(cfg.output.path)
    if resume and not replay_folder(out).is_dir():
        raise ConfigError(
            "nothing to resume: no interrupted replay of this output; run without --resume",
            str(out),
        )
    scorer = ThroughTrainingScorer(ref, run, per_ref=per_ref)
    # the output checked and held before the replay, which saves its progress beside it
    scorer.check_output(cfg.output.path, run_inputs(cfg, scorer.reads()))
    with OutputLock(cfg.output.path), terminal.progress("replay", "steps") as (on_start, on_step):
        scorer.replay(cfg, on_start, on_step)
    return scorer
