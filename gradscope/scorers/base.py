"""The scorer protocol a run drives, and the columns every scorer's rows begin and end with."""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import Tensor

from ..config import Config
from ..inputs import Inputs, check_output
from ..io.data import Batch
from ..io.parquet import PartialRun
from ..job import Job
from ..losses import nothing_counted
from ..predictions import COLUMNS, predictions


class Scorer:
    """One command's columns. A run calls, in this order:

    - ``reads()`` and ``resume_key()`` before anything runs: the scorer's own input files (the
      output may not be one of them; a resume needs them unchanged) and the options a resumed run
      must share; ``names(cfg)``, the columns it may write, lets ``--by`` be checked then too;
      ``check_output`` and ``partial`` say what the output may be and which partial run writes
      it (a Parquet file, unless a scorer says otherwise);
    - ``setup(job)`` once on every rank, with the model prepared, before the first batch (ranks
      may exchange tensors here);
    - ``columns(job, batch)`` for each batch it scores: ``{column: array}``, one row per example
      (or per example and reference);
    - ``metadata()`` when it assembles the file: the scorer's part of the ``gradscope`` key, as
      it stands after the last batch.

    A scorer is a context manager: what ``setup`` enters on ``self.stack`` is closed on exit.
    ``seconds_before`` is work it did before the scoring run (a through-training replay), which
    the file's ``seconds`` counts too.
    """

    command = "norms"

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.seconds_before = 0.0

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def reads(self) -> Inputs:
        return []

    def resume_key(self, cfg: Config) -> dict:
        return {}

    def names(self, cfg: Config) -> list[str]:
        """The columns a run of ``cfg`` may write, in order, known before it runs:
        ``grad_norm/<module>`` stands for one per module, and ``target``, ``pred``, ``prob``,
        ``margin`` and ``class_z`` are written only when the data's targets allow them."""
        raise NotImplementedError

    def check_output(self, path: str, inputs: Inputs) -> None:
        check_output(path, inputs, "scores")

    def partial(self, path: str, fingerprint: dict) -> PartialRun:
        return PartialRun(path, fingerprint)

    def setup(self, job: Job) -> None:
        """Nothing to prepare unless a scorer says otherwise."""

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def metadata(self) -> dict:
        return {}


def leading(batch: Batch) -> dict[str, np.ndarray]:
    """``example_id``, and ``id`` when ``data.ids`` is set: the columns every row begins with."""
    columns = {"example_id": batch.index.numpy()}
    if batch.ids is not None:
        columns["id"] = batch.ids
    return columns


def leading_names(cfg: Config) -> list[str]:
    """The names of the ``leading`` columns."""
    return ["example_id"] + (["id"] if cfg.data.ids else [])


def trailing_names(cfg: Config) -> list[str]:
    """The columns every row may end with: the target, the model's prediction for
    classification losses, ``robust_z`` and ``class_z`` (added when the file is assembled) and
    ``finite``."""
    predicted = list(COLUMNS) if predictions(cfg.loss.name) else []
    return ["target", *predicted, "robust_z", "class_z", "finite"]


def all_finite(*values: Tensor) -> Tensor:
    """(B,) whether every one of the (B,) ``values`` is finite, on the CPU."""
    return torch.stack([torch.isfinite(v.cpu()) for v in values]).all(0)


def counted(job: Job, batch: Batch, losses: list[Tensor]) -> list[Tensor]:
    """The (B,) float64 losses (one per checkpoint) with NaN where the example counts no target
    (every target ignore_index): a mean over nothing is no loss of 0, and the row's ``finite``
    is false, so that no ranking takes it for the best-fitted row. Its gradient is zero."""
    losses = [loss.double().cpu() for loss in losses]
    empty = nothing_counted(job.cfg.loss.name, job.cfg.loss.kwargs, batch.targets)
    if empty is None or not empty.any():
        return losses
    return [loss.masked_fill(empty, float("nan")) for loss in losses]
