"""Retraining: the models a validation needs and its truth file lacks, trained in processes and
torchrun ranks, each written as a part the moment it is trained (``run.py``'s partial folder and
resume fingerprint), then assembled with the truth's earlier models into the truth file."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import distributed, training
from ..config import Config
from ..distributed import World
from ..errors import DataError, Interrupted, ModelError, reading
from ..inputs import run_inputs
from ..io.data import open_dataset
from ..io.files import file_sha256
from ..io.parquet import PartialRun
from ..job import config_forward, config_loss, resolve_device
from ..predictions import predictions
from ..resume import Parts, fingerprint, refuse_unresumed, resumed_parts
from ..training.loop import TrainingRows, build, forward_or_error
from .truth import Model, Task, Truth, read_truth

Progress = Callable[[int], None]
Keep = Callable[[int, Model], None]


def evaluate(cfg: Config, model: nn.Module, ref: str) -> tuple[np.ndarray, np.ndarray]:
    """(R,) loss and (R,) margin of each REF example under ``model`` (margin NaN where the
    config's loss has no single label), in REF's order; REF's rows read and moved to the
    model's device as the training rows are."""
    data = dataclasses.replace(cfg.data, path=ref, ids=None, limit=None)
    return _through(dataclasses.replace(cfg, data=data), model, "on REF", f"--ref {ref}")


def _through(cfg: Config, model: nn.Module, what: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(N,) loss and (N,) margin of each row of ``cfg``'s data under ``model``."""
    rows = TrainingRows(cfg, None)
    forward = config_forward(cfg)
    loss_fn, observe = config_loss(cfg), predictions(cfg.loss.name, cfg.loss.kwargs)
    losses, margins = [], []
    with torch.no_grad():
        for picked in torch.arange(len(rows)).split(cfg.data.batch_size):
            x, y = rows.batch(picked)
            outputs = forward_or_error(forward, model, x, what, where)
            losses.append(loss_fn(outputs, y).double().cpu())  # (B,)
            seen = observe(outputs, y) if observe else {}
            nan = torch.full((len(picked),), np.nan, dtype=torch.float64)
            margins.append(seen["margin"].double().cpu() if "margin" in seen else nan)  # (B,)
    return torch.cat(losses).numpy(), torch.cat(margins).numpy()


def check_ref(cfg: Config, ref: str) -> None:
    """REF and the training rows through the model as training begins it: a REF the model
    cannot take, a loss that cannot read its targets, or one not finite (a NaN in REF: every
    model's target there would be, and its LDS none; in a training row: every retrain keeping
    it diverges), is one line before anything trains."""
    with torch.random.fork_rng(devices=[]):
        model = build(cfg, cfg.train.seed)
        with reading(f"--ref {ref}"):
            loss, _ = evaluate(cfg, model, ref)
        _finite(loss, "REF example", "no retrained model can be measured on it", f"--ref {ref}")
        loss, _ = _through(cfg, model, "on the training rows", "data.path")
        _finite(loss, "training row", "every retrain that keeps it diverges", "data.path")


def _finite(loss: np.ndarray, row: str, so: str, where: str) -> None:
    bad = np.flatnonzero(~np.isfinite(loss))
    if len(bad):
        raise DataError(
            f"{row} {bad[0]}'s loss is {loss[bad[0]]} under the model as training begins it "
            f"({len(bad)} of {len(loss)} not finite): {so}",
            where,
        )


@dataclasses.dataclass(frozen=True)
class Retrain:
    """How each model is trained, then read on REF: ``fit(cfg, task.rows, seed=task.seed)``,
    the subset alone; or, with ``weighed`` (N, every training row), every row in the full
    run's batches and order with the rows left out weighted 0 (the through-training setting:
    same seed, same order)."""

    cfg: Config
    ref: str
    weighed: int | None = None

    def __call__(self, task: Task) -> Model:
        start = time.perf_counter()
        try:
            if self.weighed is not None:
                weights = np.zeros(self.weighed)
                weights[task.rows] = 1.0
                model = training.fit(self.cfg, seed=task.seed, weights=weights)
            else:
                model = training.fit(self.cfg, task.rows, seed=task.seed)
        except ModelError as e:  # training diverged: which of the many models
            raise ModelError(f"{e.what}; in {_named(task)}", e.where) from e
        seconds = time.perf_counter() - start
        return Model(task, *evaluate(self.cfg, model, self.ref), seconds)


def _named(task: Task) -> str:
    """The model ``task`` trains, as an error names it."""
    which = {"subset": f"subset {task.subset}", "full": "the full data"}.get(task.kind)
    which = which or f"{task.kind} rows of REF example {task.ref}"
    return f"the retrain on {which} ({len(task.rows)} rows, seed {task.seed})"


def task_rows(cfg: Config) -> int:
    """N, the training rows: ``data.path``'s, up to ``data.limit``."""
    data = open_dataset(cfg.data)
    return len(data) if cfg.data.limit is None else min(len(data), cfg.data.limit)


def _one_thread() -> None:
    torch.set_num_threads(1)  # N processes on N cores, not N x N threads


def _in_processes(retrain: Retrain, todo: list[tuple[int, Task]], jobs: int, keep: Keep) -> None:
    """``keep(part number, model)`` as each finishes in ``jobs`` spawned processes. On an error
    or Ctrl-C nothing new starts, what runs finishes, and every model finished by then is kept
    before the error goes on."""
    context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_one_thread)
    futures = {pool.submit(retrain, task): n for n, task in todo}
    kept = set()
    try:
        for future in as_completed(futures):
            kept.add(future)
            keep(futures[future], future.result())
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        for future, number in futures.items():
            if future not in kept and not future.cancelled() and future.exception() is None:
                keep(number, future.result())
        raise
    pool.shutdown()


def digest(tasks: list[Task]) -> str:
    """One sha256 over the tasks' seeds and rows, in order: a resume must train the same."""
    text = "\n".join(f"{t.kind} {t.subset} {t.ref} {t.key}" for t in tasks)
    return hashlib.sha256(text.encode()).hexdigest()


def _train(
    parts: Parts,
    retrain: Retrain,
    todo: list[tuple[int, Task]],
    jobs: int,
    on_model: Progress | None,
) -> None:
    """Train ``todo`` here or in ``jobs`` processes, each model a part the moment it is
    trained; Ctrl-C keeps them."""
    saved = len(parts.done or ())

    def keep(number: int, model: Model) -> None:
        nonlocal saved
        parts.write(number, model.columns())
        saved += 1
        if on_model:
            on_model(1)

    try:
        if jobs == 1:
            for number, task in todo:
                keep(number, retrain(task))
        else:
            _in_processes(retrain, todo, jobs, keep)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted with {saved} retrained models saved; run the same command with "
            "--resume to continue",
            str(parts.run.dir),
        ) from None


def train_missing(
    cfg: Config,
    ref: str,
    tasks: list[Task],
    truth: Truth,
    path: Path,
    world: World,
    *,
    same_order: bool = False,
    jobs: int = 1,
    resume: bool = False,
    on_start: Progress | None = None,
    on_model: Progress | None = None,
) -> Truth | None:
    """Train the ``tasks`` that ``truth`` lacks and write the truth file at ``path`` with the
    earlier models and the new ones; the truth as written (on rank 0; None on the others).
    Each is trained as ``Retrain`` says; ``same_order`` weighs every row instead of training
    the subset alone.

    Each model is a part of ``path``'s partial folder as soon as it is trained; Ctrl-C or a crash
    keeps them, and ``resume`` continues a run with the same fingerprint (config, files, the
    truth's models and the tasks). Rank r of a torchrun world trains tasks r, r + size, ...
    """
    missing = list({t.key: t for t in tasks if truth.find(t) is None}.values())
    if not missing:
        return truth
    earlier = len(truth.models)  # parts 0 .. earlier-1: the truth's models, written at the end
    kind = resolve_device(world.device(cfg.device)).type
    held = file_sha256(path) if path.is_file() else None  # the earlier models, as a file
    extra = {"truth": truth.metadata(), "truth_sha256": held, "tasks": digest(missing)}
    key = fingerprint(cfg, "validate", run_inputs(cfg, [("--ref", ref)]), extra, kind)
    run = PartialRun(path, key)
    run.refuse_foreign()
    if not resume:
        saved = run.saved()
        refuse_unresumed(
            run, key, f"{saved} retrained model{'s' * (saved != 1)}" if saved else None
        )
    parts = Parts(run, world, key, resumed_parts(run, key) if resume else None)
    todo = [(earlier + n, t) for n, t in enumerate(missing) if parts.wanted(earlier + n)]
    if on_start:
        on_start(len(todo))
    here = dataclasses.replace(cfg, device=world.device(cfg.device))  # a rank's own GPU
    weighed = task_rows(cfg) if same_order else None  # N, read once for every model
    _train(parts, Retrain(here, ref, weighed), todo, jobs, on_model)
    parts.begin()  # a rank with nothing left to train still meets the others
    distributed.barrier()
    if not world.main:
        return None
    try:
        for number, model in enumerate(truth.models):
            run.write(number, model.columns())
        run.assemble(earlier + len(missing), truth.metadata())
    except KeyboardInterrupt:  # every model is saved: only the file is left to write
        raise Interrupted(
            "interrupted while writing the truth file, every model saved; run the same "
            "command with --resume to write it",
            str(run.dir),
        ) from None
    return read_truth(path, truth.identity)
