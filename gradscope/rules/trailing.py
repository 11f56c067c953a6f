"""Rows that add nothing: where an example's last rows (positions) of a product's output
gradient are zeros, its terms there are zeros, and its gradient sums only the rows before them
(``Outer.lengths``). A sequence's padding at its end gives them, and so does a head that reads
one position (a classifier's first token: every later row of the last layer): on W6's padded
BERT batch, a fifth of the rows of every layer but the last, and all but one of the last's.

The lengths are read on the host: a read that waits for nothing on the CPU (``FREE``); a
device's pass, which would wait for it at every layer, cuts nothing."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import accumulation_dtype

# The devices where reading the lengths on the host waits for nothing
FREE = frozenset({"cpu"})
# Rows are cut where no more than this share of the batch's rows is left: above it, cutting
# saves less than the per-example products it costs
WORTH = 0.9
# Nothing is read for products of no more multiply-adds over the batch: they cost less than the
# reads that would cut them (24 us a call where no example ends in zeros, on the CPU of
# 2026-12-07: a twentieth of T3's whole pass)
SMALL = 1 << 24


def trailing(s: Tensor, a: Tensor) -> list[int] | None:
    """Each example's rows up to its last whose output gradient is not zero, of ``s`` (B, G, T,
    O) and ``a`` (B, G, T, I); None where the product is small, every example's last row
    holds one, too few rows are cut, the host read would wait for a device, or an input is not
    finite (a term of a zero gradient and an infinite input is not zero: the loop's NaN)."""
    b, g, t, o = s.shape
    if t < 2 or s.device.type not in FREE or b * g * t * o * a.shape[-1] <= SMALL:
        return None
    if bool(s[:, :, -1].ne(0).any((1, 2)).all()):  # read first: no padding, at little cost
        return None
    live = ((s.amax(-1) != 0) | (s.amin(-1) != 0)).any(1)  # (B, T): no copy of s made
    ends = torch.where(live.any(-1), t - live.flip(-1).to(torch.uint8).argmax(-1), 0)
    lengths = ends.tolist()
    if sum(lengths) > WORTH * b * t:
        return None
    # a finite sum (float16's in float32: 65504 is its largest) says every input is finite
    if not bool(a.sum(dtype=accumulation_dtype(a.dtype)).isfinite()):
        return None
    return lengths
