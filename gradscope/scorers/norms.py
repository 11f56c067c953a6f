"""The ``norms`` command's scorer: each example's loss and the norm of its own loss gradient."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from ..engine.core import BatchScores, total
from ..io.data import Batch
from ..job import Job
from .base import Scorer, all_finite, leading


class NormsScorer(Scorer):
    """example_id, id, loss, grad_norm, grad_norm/<module> (``output.per_layer``), target, finite."""

    command = "norms"

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        scores = job.engine.norms(*job.to_device(batch))
        return self.table(job, batch, scores)

    def table(self, job: Job, batch: Batch, scores: BatchScores) -> dict[str, np.ndarray]:
        """The rows of one batch in column order: the one place the norms columns are built."""
        loss, norm_sq = scores.loss.double().cpu(), total(scores.norm_sq).cpu()
        columns = leading(batch)
        columns["loss"] = loss.numpy()
        columns["grad_norm"] = norm_sq.sqrt().numpy()
        if job.cfg.output.per_layer:
            columns |= per_module(job, scores)
        if batch.targets.dim() == 1:
            columns["target"] = batch.targets.numpy()
        columns["finite"] = all_finite(loss, norm_sq).numpy()
        return columns


def per_module(job: Job, scores: BatchScores) -> dict[str, np.ndarray]:
    """``grad_norm/<module>``: the norm over each module's selected parameters."""
    sums: dict[str, Tensor] = {}
    for p in job.plan.included:
        sums[p.module] = sums.get(p.module, 0) + scores.norm_sq[p.name].double()
    return {f"grad_norm/{m}": sums[m].sqrt().cpu().numpy() for m in job.plan.modules}
