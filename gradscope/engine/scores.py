"""What one pass gives for a batch: each example's loss and, per parameter, its squared norm,
inner products, kept factors, preconditioned norms or the batch gradient a training step asks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..rules import Contribution


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
