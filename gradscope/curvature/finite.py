"""Examples left out of the factors: one whose loss or gradient has a NaN or inf would make
every block it touches NaN, so its parts are zeroed (and it is not counted)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..rules import Contribution, Dense, Outer, Rows

Parts = dict[str, Contribution | None]


def _finite(c: Contribution) -> Tensor:
    """(B,) whether each example's part of the gradient is finite everywhere: its sum is (a NaN
    or inf anywhere makes it NaN or inf; float32 or wider, where a sum of finite values does not
    overflow), one reduction and no (B, ...) mask."""
    if isinstance(c, Outer):
        held = (c.s, c.a)
    elif isinstance(c, Rows) or type(c) is Dense:
        held = (c.s if isinstance(c, Rows) else c.grads,)
    else:  # formed a few examples at a time: its norms tell, without holding them all
        return torch.isfinite(c.norm_sq())
    return torch.isfinite(sum(t.flatten(1).sum(1) for t in held))


def _zeroed(c: Contribution, bad: Tensor) -> Contribution:
    """``c`` with the examples where ``bad`` is set at zero: they add nothing to any sum."""

    def zero(t: Tensor) -> Tensor:
        return t.masked_fill(bad.to(t.device).view(-1, *[1] * (t.dim() - 1)), 0)

    if isinstance(c, Outer):  # zero rows are not counted positions either
        return Outer(zero(c.s), zero(c.a), c.shape, c.lengths)
    if isinstance(c, Rows):
        return Rows(c.ids, zero(c.s), c.shape[0])
    return Dense(zero(c.grads if isinstance(c, Dense) else c.materialize()))


def finite_parts(loss: Tensor, parts: Parts) -> tuple[Parts, int]:
    """The parts with every example whose loss or gradient has a NaN or inf left out (zeroed),
    and how many were: one such example would make every block it touches NaN."""
    keep = torch.isfinite(loss.detach())
    for c in parts.values():
        if c is not None:
            keep &= _finite(c).to(keep.device)
    bad = ~keep
    if not bad.any():
        return parts, 0
    zeroed = {n: None if c is None else _zeroed(c, bad) for n, c in parts.items()}
    return zeroed, int(bad.sum())
