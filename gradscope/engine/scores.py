"""What one pass gives for a batch: each example's loss and, per parameter, its squared norm,
inner products, kept factors, preconditioned norms or the batch gradient a training step asks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..rules import Contribution

if TYPE_CHECKING:
    from .backward.reduce import Want


@dataclass
class BatchScores:
    """What one pass gives for a batch of B examples."""

    loss: Tensor  # (B,) each example's own loss
    norm_sq: dict[str, Tensor]  # parameter name -> (B,) squared norm of its per-example gradient
    inner: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, K) <G_i, refs[name][k]>
    observed: dict[str, Tensor] = field(default_factory=dict)  # what ``observe`` read, (B,) each
    kept: dict[str, Contribution] = field(default_factory=dict)  # with Want(keep=True)
    pre_sq: dict[str, Tensor] = field(default_factory=dict)  # with Want(transform=...): g^T P g
    trained: list[Tensor | None] = field(default_factory=list)  # with Want(train=...)


def total(per_param: dict[str, Tensor]) -> Tensor:
    """The sum over parameters of per-parameter, per-example quantities, in float64: one cast
    of them all where they share a dtype (hundreds of small casts cost a pass ~0.2 ms)."""
    values = list(per_param.values())
    if any(v.dtype != values[0].dtype for v in values):
        values = [v.double() for v in values]
    return torch.stack(values).double().sum(0)


def empty(names: Sequence[str], targets: Tensor, want: Want) -> BatchScores:
    """The scores of an empty batch, with no pass: (0,) losses and norms, and (0, K) inner
    products with the references (or the projections) where ``want`` asks for them."""
    none = targets.new_zeros(0, dtype=torch.float64)
    width = {n: len(r) for n, r in (want.refs or {}).items()}
    width |= {n: p.dim for n, p in (want.project or {}).items()}
    inner = {n: targets.new_zeros(0, k, dtype=torch.float64) for n, k in width.items()}
    return BatchScores(none, {n: none for n in names}, inner)
