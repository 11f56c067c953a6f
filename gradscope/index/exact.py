"""``--exact``: each reference's candidates (the top of the projected ranking) scored again by the
exact engine, the examples read back from the data, and ranked by the exact scores."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..engine import Influence
from ..errors import DataError
from ..io.data import open_dataset
from ..job import Job
from .references import References

# reference directions formed at once: at most this many floats (2 GiB of float32)
REFS_ELEMENTS = 1 << 29


def exact_scores(
    job: Job, refs: References, candidates: Tensor, normalize: bool
) -> tuple[Tensor, Tensor]:
    """(M, R) float64 exact scores of the examples at ``candidates`` ((M, R) example ids, one
    column per reference): ``<g_i, r>``, or the cosine with ``normalize``; and (M, R) their
    losses. References are taken a few at a time (``REFS_ELEMENTS``), each group's candidates
    read from the data in one pass and scored in one pass of the hook engine against the
    group's directions."""
    params = sum(p.param.numel() for p in job.plan.included)
    step = max(1, REFS_ELEMENTS // max(1, params))
    data = open_dataset(job.cfg.data)
    out = torch.full(candidates.shape, math.nan, dtype=torch.float64)
    loss = out.clone()
    for lo in range(0, candidates.shape[1], step):
        hi = min(lo + step, candidates.shape[1])
        wanted = candidates[:, lo:hi]  # (M, r) example ids
        examples = torch.unique(wanted)  # sorted
        scored = torch.empty(len(examples), hi - lo, dtype=torch.float64)
        losses = torch.empty(len(examples), dtype=torch.float64)
        influence = Influence(job.engine, refs.dense(lo, hi), "hooks", norms=normalize)
        ref_norm = influence.ref_norm.cpu()
        for batch in data.rows_at(examples.tolist(), job.cfg.data.batch_size):
            result = influence(*job.to_device(batch))
            inner = result.inner.cpu()  # (b, r)
            if normalize:
                inner = inner / (result.norm_sq.cpu().sqrt()[:, None] * ref_norm[None])
            at = torch.searchsorted(examples, batch.index)
            scored[at], losses[at] = inner, result.loss.cpu()
        columns, at = torch.arange(hi - lo).expand_as(wanted), torch.searchsorted(examples, wanted)
        out[:, lo:hi], loss[:, lo:hi] = scored[at, columns], losses[at]
    return out, loss


def check_rows(indexed: Tensor, loss: Tensor, dtype: torch.dtype, where: str) -> None:
    """The candidates' losses read again (``loss``) must be the indexed ones, within the model's
    precision (relative, ``sqrt(eps)`` of float64; 2% or ``sqrt(eps)`` below it, where two passes
    may differ by more than rounding: cuDNN's TF32 convolutions, a device other than the
    build's): a row that changed since the index was built (where no sha256 tells: an index of
    data made by code built before its rows had one) is refused, not scored as another."""
    tol = math.sqrt(torch.finfo(dtype).eps)
    if dtype != torch.float64:
        tol = max(tol, 0.02)
    both = torch.isfinite(indexed) & torch.isfinite(loss)
    same = torch.where(
        both,
        (indexed - loss).abs() <= tol * torch.maximum(indexed.abs(), loss.abs()).clamp_min(1),
        torch.isfinite(indexed) == torch.isfinite(loss),
    )
    if not bool(same.all()):
        raise DataError(
            "--exact reads the indexed examples again, but their losses are not the indexed "
            "ones: the data has changed since the index was built; build the index again",
            where,
        )


def rerank(exact: Tensor, k: int) -> tuple[Tensor, np.ndarray]:
    """(k, R) positions among the candidates of each reference's k highest exact scores
    (highest first, NaN last), and the deepest such position per reference (0-based)."""
    key = torch.nan_to_num(exact, nan=-math.inf)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:k]  # (k, R)
    return order, order.max(0).values.numpy()
