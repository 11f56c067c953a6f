"""The reference side of a query: REF's gradients at the indexed model (the mean-loss gradient,
or each row's own with ``per_ref``), preconditioned as ``influence`` does, then projected as the
index's rows were."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from ..engine import Want, reference_gradients
from ..io.data import open_dataset
from ..job import Job
from .projection import Projector

Batches = Iterator[tuple[tuple[Tensor, ...], Tensor]]


class References:
    """REF's ``count`` reference directions: ``projected()`` for the streamed scores,
    ``dense(lo, hi)`` (formed, for the exact engine) a few at a time. The job's engine must be
    prepared (``with job.engine``) while either is asked. A factors file must come from the
    model ``made`` describes (its ``checkpoint_sha256`` and ``adapter_sha256``)."""

    def __init__(
        self,
        job: Job,
        ref: str,
        projector: Projector,
        per_ref: bool = False,
        precondition: str | Path | None = None,
        made: dict | None = None,
    ):
        self.job, self.projector, self.per_ref = job, projector, per_ref
        # REF is read with the data's input and target names; its rows need no ids
        self.data = open_dataset(
            dataclasses.replace(job.cfg.data, ids=None, limit=None), ref, "--ref"
        )
        self.count = len(self.data) if per_ref else 1
        self.pre = None
        if precondition is not None:
            from ..curvature import load_preconditioner

            self.pre = load_preconditioner(precondition, job.engine, made)
        self._mean: dict[str, Tensor] | None = None

    def _batches(self, lo: int = 0, hi: int | None = None) -> Batches:
        """REF's batches on the job's device, cut to rows ``lo .. hi - 1``."""
        for batch in self.data.batches(self.job.cfg.data.batch_size):
            first = int(batch.index[0])
            a, b = max(lo, first) - first, len(batch) if hi is None else min(hi - first, len(batch))
            if b <= 0:
                return
            if a < b:
                inputs, targets = self.job.to_device(batch)
                yield tuple(t[a:b] for t in inputs), targets[a:b]

    def _preconditioned(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return grads if self.pre is None else self.pre.refs(grads)

    def dense(self, lo: int, hi: int) -> dict[str, Tensor]:
        """{name: (hi - lo, *shape)} reference directions ``lo .. hi - 1``, formed."""
        if not self.per_ref:
            if self._mean is None:
                self._mean = self._preconditioned(
                    reference_gradients(self.job.engine, self._batches())
                )
            return self._mean
        return self._preconditioned(
            reference_gradients(self.job.engine, self._batches(lo, hi), per_ref=True)
        )

    def projected(self) -> Tensor:
        """(count, width) the reference directions projected: each row's from the projecting
        pass, with no gradient formed, unless a preconditioner needs them formed."""
        if not self.per_ref:
            return self.projector.dense(self.dense(0, 1))
        want = Want(norms=False, project=self.projector.projections)
        rows = []
        for inputs, targets in self._batches():
            if self.pre is None:
                scores = self.job.engine.scores(inputs, targets, want)
                rows.append(self.projector.rows(scores.inner))
            else:
                formed = reference_gradients(self.job.engine, [(inputs, targets)], per_ref=True)
                rows.append(self.projector.dense(self.pre.refs(formed)))
        return torch.cat(rows)
