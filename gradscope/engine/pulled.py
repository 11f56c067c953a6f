"""One parameter's per-example gradient through tensors computed from it alone
(``derived.Computed``), kept as each tensor's gradients until asked for, then carried back by
one VJP for them all (``vjps.py``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..rules import Contribution, Dense
from . import vjps

if TYPE_CHECKING:
    from .derived import Computed


class Pulled(Contribution):
    """One parameter's per-example gradient through tensors ``Computed`` from it alone, kept as
    each tensor's (B, *its shape) gradients until asked for: the reads of one tensor (Mistral
    Large 4's rotary table scaled by a learned ``alpha``, read by each query and key) merge by
    adding those, and one VJP per tensor then forms the parameter's, where one per read would
    give the same sum (the VJP is linear in the gradient)."""

    def forms(self, *, train: bool) -> bool:
        return True

    def __init__(self, pending: dict[Computed, Tensor], shape: torch.Size):
        self.pending = pending  # each tensor computed from the parameter -> its gradients
        self.shape = shape

    @functools.cached_property
    def formed(self) -> Dense:
        """The parameter's gradients: each tensor's VJP written out where it has one, and
        the rest's by one VJP for each dtype their leaf has (a cast of the parameter is
        placed in it as the parameter is), of them all together (``vjps.py``: a rotary
        table's cos and sin, made again in each layer, read by its queries and keys)."""
        written = [c.back(g)[0] for c, g in self.pending.items() if c.back is not None]
        by_dtype: dict[torch.dtype, list[tuple[Computed, Tensor]]] = {}
        for c, g in self.pending.items():
            if c.back is None:
                by_dtype.setdefault(c.values[0].dtype, []).append((c, g))
        for rest in by_dtype.values():
            written.append(_joint(rest) if len(rest) > 1 else rest[0][0].carry(rest[0][1])[0])
        return Dense(functools.reduce(torch.add, written))

    def norm_sq(self) -> Tensor:
        return self.formed.norm_sq()

    def inner(self, refs: Tensor) -> Tensor:
        return self.formed.inner(refs)

    def materialize(self) -> Tensor:
        return self.formed.grads

    def merge(self, other: Contribution) -> Contribution:
        if not isinstance(other, Pulled):
            return self.formed.merge(other)
        pending = dict(self.pending)
        for computed, g in other.pending.items():
            pending[computed] = pending[computed] + g if computed in pending else g
        return Pulled(pending, self.shape)


def _joint(pending: list[tuple[Computed, Tensor]]) -> Tensor:
    """(B, *parameter's shape): the sum of the VJPs of tensors computed from one parameter
    alone (one leaf each, of one dtype), each of its gradients, by one VJP of them all."""
    funcs = [c.func for c, _ in pending]
    kind = ("joint", *(c.kind for c, _ in pending))
    values = pending[0][0].values  # each the parameter, detached where read
    grads = tuple(g for _, g in pending)
    return vjps.back(kind, lambda v: tuple(f(v) for f in funcs), values, grads)[0]
