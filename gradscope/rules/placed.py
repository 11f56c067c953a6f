"""Contributions to part of a parameter: a fused expert weight ``W[e]``, a slice, a transpose.

A function may read a view of a parameter (``F.linear(x, W[e])``, ``x @ W.T``, ``1 + w``): the
rule for that function gives the per-example gradient of the view, and ``Placed`` puts it back
where the view sits. Views of one parameter that do not overlap (the experts of one pass) add
their norms, ``||G_i||^2 = sum_e ||G_i[e]||^2``; overlapping ones are formed and added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Contribution, Dense
from .projection import Projection


@dataclass(frozen=True)
class Place:
    """Where a view sits in its parameter: ``param[index]``, then transposed, times ``scale``."""

    index: tuple = ()  # ints and slices, one per leading dimension
    transposed: bool = False
    scale: float = 1.0

    def of(self, t: Tensor) -> Tensor:
        """The view of ``t`` ((K, *param shape), K leading) that this place reads."""
        view = t[(slice(None), *self.index)]
        return (view.transpose(-1, -2) if self.transposed else view) * self.scale

    def put(self, out: Tensor, view: Tensor) -> None:
        """Write ``view`` (the view's own shape, unscaled) where this place sits in ``out``
        (the parameter's shape)."""
        view = view * self.scale if self.scale != 1.0 else view
        out[self.index] = view.transpose(-1, -2) if self.transposed else view

    def mask(self, shape: torch.Size) -> Tensor:
        """(*shape) bool: the parameter's elements this place covers."""
        covered = torch.zeros(shape, dtype=torch.bool)
        covered[self.index] = True
        return covered


class Placed(Contribution):
    """``part`` (per-example gradients of a view) placed into a parameter of ``shape``."""

    def __init__(self, part: Contribution, shape: torch.Size, place: Place):
        self.part, self.shape, self.place = part, torch.Size(shape), place

    def norm_sq(self) -> Tensor:
        return self.part.norm_sq() * self.place.scale**2

    def inner(self, refs: Tensor) -> Tensor:
        return self.part.inner(self.place.of(refs))

    def materialize(self) -> Tensor:
        view = self.part.materialize() * self.place.scale
        view = view.transpose(-1, -2) if self.place.transposed else view
        out = view.new_zeros(view.shape[0], *self.shape)
        out[(slice(None), *self.place.index)] = view
        return out

    def project(self, p: Projection) -> Tensor:
        """The view's own projection (the rows of P_out it covers), placed back; the gradient
        formed where the view is not a block of rows (``Projection.of_view``)."""
        view = p.of_view(self.place.index, self.place.transposed)
        if view is None:
            return super().project(p)
        sub, back = view
        return back(self.part.project(sub)) * self.place.scale

    def forms(self, *, train: bool) -> bool:
        return self.part.forms(train=train)

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        norm_sq, view = self.part.norm_sq_and_sum()
        out = view.new_zeros(self.shape)
        self.place.put(out, view)
        return norm_sq * self.place.scale**2, out

    def batch_sum(self) -> Tensor:
        view = self.part.batch_sum()
        out = view.new_zeros(self.shape)
        self.place.put(out, view)
        return out

    def examples(self, lo: int, hi: int) -> Contribution:
        return Placed(self.part.examples(lo, hi), self.shape, self.place)

    def merge(self, other: Contribution) -> Contribution:
        if isinstance(other, Placed) and other.place == self.place:
            return Placed(self.part.merge(other.part), self.shape, self.place)
        return Blocks([self]).merge(other)


class Blocks(Contribution):
    """Placed contributions that cover no element twice: norms and inner products add up."""

    def __init__(self, blocks: list[Placed]):
        self.blocks, self.shape = blocks, blocks[0].shape

    def norm_sq(self) -> Tensor:
        return sum(b.norm_sq() for b in self.blocks)

    def inner(self, refs: Tensor) -> Tensor:
        return sum(b.inner(refs) for b in self.blocks)

    def materialize(self) -> Tensor:
        return sum(b.materialize() for b in self.blocks)

    def project(self, p: Projection) -> Tensor:
        return sum(b.project(p) for b in self.blocks)

    def forms(self, *, train: bool) -> bool:
        """Whether a block forms its examples' gradients: the sum of the others is then their
        own share of the batch gradient's product (the experts of a training step)."""
        return any(b.forms(train=train) for b in self.blocks)

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        """Each block's squared norms and batch sum (``Outer.norm_sq_and_sum``), the sums
        written into one tensor of the parameter's shape: the blocks cover no element twice."""
        norm_sq, out = 0, None
        for b in self.blocks:
            n, view = b.part.norm_sq_and_sum()
            out = view.new_zeros(self.shape) if out is None else out
            b.place.put(out, view)
            norm_sq = norm_sq + n * b.place.scale**2
        return norm_sq, out

    def batch_sum(self) -> Tensor:
        return sum(b.batch_sum() for b in self.blocks)

    def examples(self, lo: int, hi: int) -> Contribution:
        return Blocks([b.examples(lo, hi) for b in self.blocks])

    def merge(self, other: Contribution) -> Contribution:
        others = other.blocks if isinstance(other, Blocks) else [other]
        blocks = list(self.blocks)
        for o in others:
            same = next(
                (i for i, b in enumerate(blocks) if isinstance(o, Placed) and b.place == o.place),
                None,
            )
            if same is not None:
                blocks[same] = blocks[same].merge(o)
            elif isinstance(o, Placed) and not _overlap(blocks, o):
                blocks.append(o)
            else:  # overlapping views: formed and added
                return Dense(self.materialize() + other.materialize())
        return Blocks(blocks)


def _overlap(blocks: list[Placed], new: Placed) -> bool:
    """Whether ``new`` covers an element one of ``blocks`` covers: from the index ranges where
    they are plain (ints, slices of step 1: the experts of a pass), else from masks."""
    ranges = _ranges(new.place.index, new.shape)
    if ranges is None:
        covered = new.place.mask(new.shape)
        return any(bool((b.place.mask(b.shape) & covered).any()) for b in blocks)
    for b in blocks:
        other = _ranges(b.place.index, b.shape)
        if other is None:
            if bool((b.place.mask(b.shape) & new.place.mask(new.shape)).any()):
                return True
        elif all(lo < hi2 and lo2 < hi for (lo, hi), (lo2, hi2) in zip(ranges, other, strict=True)):
            return True
    return False


def _ranges(index: tuple, shape: torch.Size) -> list[tuple[int, int]] | None:
    """[start, stop) per dimension of a basic index of ints and step-1 slices, or None."""
    out = []
    for d, n in enumerate(shape):
        k = index[d] if d < len(index) else slice(None)
        if isinstance(k, int):
            k %= n
            out.append((k, k + 1))
        elif isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step != 1:
                return None
            out.append((start, max(start, stop)))
        else:
            return None
    return out
