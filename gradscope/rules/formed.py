"""Per-example gradients formed a few examples at a time where no factored form exists (a
convolution's weight, a tensor computed from parameters): ``Formed``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .base import Contribution, Dense, _acc, _cat, _dots, _sq_norm, rows

if TYPE_CHECKING:
    from .projection import Projection


class Formed(Dense):
    """Per-example gradients formed a few examples at a time, ``form(lo, hi)`` -> (hi - lo, *shape),
    and reduced chunk by chunk: norms, inner products and the batch sum never hold the (B, *shape)
    gradients (nor what forming them takes) of more than ``step`` examples at once. Each question
    forms them again; ``grads`` forms them all, for callers that need every one."""

    def __init__(
        self, form: Callable[[int, int], Tensor], batch: int, shape: torch.Size, step: int
    ):
        self.form, self.batch, self.step = form, batch, step
        self.shape = torch.Size(shape)

    def _chunks(self) -> Iterator[Tensor]:
        for lo in range(0, self.batch, self.step):
            yield _acc(self.form(lo, min(lo + self.step, self.batch)))  # (b, *shape)

    @property
    def grads(self) -> Tensor:
        return torch.cat(list(self._chunks()))  # (B, *shape)

    def norm_sq(self) -> Tensor:
        return _cat([_sq_norm(rows(m)) for m in self._chunks()])

    def inner(self, refs: Tensor) -> Tensor:
        return _cat([_dots(rows(m), rows(refs.to(m.dtype))) for m in self._chunks()])

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        norms, inners = [], []
        for m in self._chunks():
            flat = rows(m)  # (b, P)
            norms.append(_sq_norm(flat))
            inners.append(_dots(flat, rows(refs.to(m.dtype))))
        return _cat(norms), _cat(inners)

    def project(self, p: Projection) -> Tensor:
        return _cat([p.dense(m) for m in self._chunks()])

    def batch_sum(self) -> Tensor:
        return sum(m.sum(0) for m in self._chunks())

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        norms, total = [], None
        for m in self._chunks():
            norms.append(_sq_norm(rows(m)))
            total = m.sum(0) if total is None else total + m.sum(0)
        return _cat(norms), total

    def examples(self, lo: int, hi: int) -> Contribution:
        return Formed(lambda a, b: self.form(lo + a, lo + b), hi - lo, self.shape, self.step)
