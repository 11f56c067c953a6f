"""The ``norms`` command's scorer: each example's loss and the norm of its own loss gradient."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..config import CheckpointConfig, Config
from ..engine import BatchScores, Want, total
from ..errors import ConfigError, check_file
from ..io.data import Batch
from ..io.files import file_sha256
from ..job import Job
from .base import Inputs, Scorer, all_finite, counted, leading, leading_names, trailing_names


class NormsScorer(Scorer):
    """example_id, id, loss, grad_norm, grad_norm/<module> (``output.per_layer``); with
    ``model.checkpoints`` loss@k, grad_norm@k and self_influence; target, pred, prob, margin
    (classification losses), finite.

    With ``model.checkpoints`` the job's model is at the last checkpoint; ``setup`` builds one at
    each earlier checkpoint (kept prepared until the scorer exits).

    ``precondition`` (a factors file or an Adam/AdamW state dict, told apart by content) adds
    ``self_influence = sum_k w_k g_k^T P g_k`` (one checkpoint: ``g^T P g``) from the same pass,
    ``P`` the inverse damped K-FAC / EK-FAC curvature or ``1 / (sqrt(v_hat) + eps)``.
    """

    command = "norms"

    def __init__(self, trust_checkpoint: bool = False, precondition: str | Path | None = None):
        super().__init__()
        if precondition is not None:
            check_file(precondition, "preconditioner file", ConfigError)
        self.trust_checkpoint = trust_checkpoint
        self.precondition = str(Path(precondition).resolve()) if precondition else None
        self._earlier: list[Job] = []
        self._wants: list[Want] = []  # per job, the last checkpoint's last
        self._described: dict = {}

    def reads(self) -> Inputs:
        return [("--precondition", self.precondition)] if self.precondition else []

    def names(self, cfg: Config) -> list[str]:
        names = [*leading_names(cfg), "loss", "grad_norm"]
        if cfg.output.per_layer:
            names.append("grad_norm/<module>")
        for k in range(len(cfg.model.checkpoints)):
            names += [f"loss@{k}", f"grad_norm@{k}"]
        if cfg.model.checkpoints or self.precondition:
            names.append("self_influence")
        return names + trailing_names(cfg)

    def setup(self, job: Job) -> None:
        earlier = job.cfg.model.checkpoints[:-1]
        self._earlier = [job.at_checkpoint(c.path, self.trust_checkpoint) for c in earlier]
        for other in self._earlier:
            self.stack.enter_context(other.engine)
        self._wants = [Want(norms=True) for _ in [*self._earlier, job]]
        if self.precondition:
            from ..curvature import load_preconditioner

            # the factors come from the last checkpoint's model and serve every checkpoint
            pre = [load_preconditioner(self.precondition, j.engine) for j in self._earlier]
            pre.append(load_preconditioner(self.precondition, job.engine, job.metadata("norms")))
            self._wants = [Want(norms=True, transform=p.transform) for p in pre]
            self._described = {
                "precondition": {
                    "path": self.precondition,
                    "sha256": file_sha256(self.precondition),
                    **pre[-1].describe(),
                }
            }

    def metadata(self) -> dict:
        return self._described

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        jobs = [*self._earlier, job]
        *earlier, scores = [
            j.engine.scores(*j.to_device(batch), w) for j, w in zip(jobs, self._wants, strict=True)
        ]
        return self.table(job, batch, scores, earlier)

    def table(
        self, job: Job, batch: Batch, scores: BatchScores, earlier: list[BatchScores] = ()
    ) -> dict[str, np.ndarray]:
        """The rows of one batch in column order: the one place the norms columns are built.
        ``earlier`` holds the scores at the checkpoints before the last, in order."""
        losses = counted(job, batch, [s.loss for s in [*earlier, scores]])
        norm_sq = total(scores.norm_sq).cpu()
        columns = leading(batch)
        columns["loss"] = losses[-1].numpy()
        columns["grad_norm"] = norm_sq.sqrt().numpy()
        if job.cfg.output.per_layer:
            columns |= per_module(job, scores)
        squares = [total(s.norm_sq).cpu() for s in earlier] + [norm_sq]
        if job.cfg.model.checkpoints:
            columns |= at_checkpoints(losses, squares, job.cfg.model.checkpoints)
        if scores.pre_sq:  # g^T P g, weighted over the checkpoints as TracIn's self-influence
            weights = [c.weight for c in job.cfg.model.checkpoints] or [1.0]
            pre = [total(s.pre_sq).cpu() for s in [*earlier, scores]]
            columns["self_influence"] = sum(w * p for w, p in zip(weights, pre, strict=True))
            columns["self_influence"] = columns["self_influence"].numpy()
            squares += pre
        if batch.targets.dim() == 1:
            columns["target"] = batch.targets.numpy()
        columns |= {name: t.cpu().numpy() for name, t in scores.observed.items()}
        columns["finite"] = all_finite(*losses, *squares).numpy()
        return columns


def per_module(job: Job, scores: BatchScores) -> dict[str, np.ndarray]:
    """``grad_norm/<module>``: the norm over each module's selected parameters."""
    sums: dict[str, Tensor] = {}
    for p in job.plan.included:
        sums[p.module] = sums.get(p.module, 0) + scores.norm_sq[p.name].double()
    return {f"grad_norm/{m}": sums[m].sqrt().cpu().numpy() for m in job.plan.modules}


def at_checkpoints(
    losses: list[Tensor], squares: list[Tensor], checkpoints: list[CheckpointConfig]
) -> dict[str, np.ndarray]:
    """loss@k and grad_norm@k per checkpoint (k from 0, as influence names them), and
    self_influence = sum_k w_k grad_norm@k^2 (TracIn's self-influence), from (B,) float64 losses
    and squared norms."""
    columns = {}
    for k, (loss, norm_sq) in enumerate(zip(losses, squares, strict=True)):
        columns[f"loss@{k}"] = loss.numpy()
        columns[f"grad_norm@{k}"] = norm_sq.sqrt().numpy()
    weighted = [c.weight * sq for c, sq in zip(checkpoints, squares, strict=True)]
    columns["self_influence"] = torch.stack(weighted).sum(0).numpy()
    return columns
