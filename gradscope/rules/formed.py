"""Per-example gradients formed a few examples at a time: where no factored form exists (a
convolution's weight, a tensor computed from parameters: ``Formed``), and where a training step
takes a Linear's norms and batch sum from the same G formed (``formed_sums``), and where several
calls' examples are each scored against their own references (``formed_inners``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .base import CHUNK_ELEMENTS, Contribution, Dense, _acc, _cat, _dots, _sq_norm, rows

if TYPE_CHECKING:
    from .projection import Projection

# Elements of the one buffer a training step forms its examples' G in, a chunk of examples at a
# time, for their norms and batch sum (``formed_sums``): 4 MiB in float32, which the cache still
# holds when the reductions read it, and no step's batch of G in memory at once
FORMED_ELEMENTS = 1 << 20


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


def formed_sums(
    s: Tensor, a: Tensor, lengths: Sequence[int] | None, shape: torch.Size
) -> tuple[Tensor, Tensor]:
    """(B,) squared norms and the batch sum of G_i = s_i^T a_i, s (B, G, T, O) and a (B, G, T,
    I), from each G formed once: chunks of examples one after another into one buffer
    (``FORMED_ELEMENTS``), read back for the norms and the sum from the cache; where examples
    hold their own numbers of rows (``lengths``: the tokens routed to one expert, a sequence's
    padding cut), each formed from its rows alone into its place in the chunk, no padding
    formed, the products adding up to the batch gradient's."""
    (b, g, _, o), i = s.shape, a.shape[-1]
    step = max(1, min(b, FORMED_ELEMENTS // (g * o * i)))
    if step == 1 and lengths is None:
        return _one_by_one(s, a, shape)
    work, total = s.new_empty(step, g, o, i), s.new_empty(shape)
    norms, acc = [], total.view(g, o, i)
    for lo in range(0, b, step):
        m = work[: min(step, b - lo)]  # (b, G, O, I) = (b, G, O, T) @ (b, G, T, I)
        if lengths is None:
            torch.matmul(s[lo : lo + step].mT, a[lo : lo + step], out=m)
        else:
            _each(s, a, lengths, lo, m)
        norms.append(_sq_norm(m.flatten(1)))
        if lo:
            acc.add_(m.sum(0))
        else:
            torch.sum(m, 0, out=acc)
    return _cat(norms), total


def _each(s: Tensor, a: Tensor, lengths: Sequence[int], lo: int, m: Tensor) -> None:
    """Examples ``lo`` on, each G formed from its first ``lengths`` rows into ``m``'s place,
    (G, O, I) = (G, O, n) @ (G, n, I); zeros where it holds none."""
    for k, n in enumerate(lengths[lo : lo + len(m)], lo):
        if n:
            torch.matmul(s[k, :, :n].mT, a[k, :, :n], out=m[k - lo])
        else:
            m[k - lo].zero_()


def _one_by_one(s: Tensor, a: Tensor, shape: torch.Size) -> tuple[Tensor, Tensor]:
    """``formed_sums`` of G too large for two in the buffer (W9's output layer's): the first
    example's formed in the sum itself, each other's in one buffer and added as it is, no copy
    of the first made (a copy of W9's 8 MiB, 1 ms a step)."""
    (b, g, _, o), i = s.shape, a.shape[-1]
    total = s.new_empty(shape)
    acc = total.view(g, o, i)
    work = s.new_empty(g, o, i) if b > 1 else acc
    norms = []
    for k in range(b):
        m = acc if k == 0 else work  # (G, O, I) = (G, O, T) @ (G, T, I)
        torch.matmul(s[k].mT, a[k], out=m)
        norms.append(_sq_norm(m.view(1, -1)))
        if k:
            acc.add_(m)
    return _cat(norms), total


def formed_inners(
    s: Tensor, a: Tensor, shape: torch.Size, refs: Sequence[Tensor], batch: int
) -> Tensor:
    """(n, batch, K) as ``Outer.inners``, s (n * batch, G, T, O) and a (n * batch, G, T, I),
    from each example's G_i formed, a few calls at a time, each call's against its own
    references: (B, P) @ (P, K), no stack of them made."""
    p = shape.numel()
    # calls formed at a time: their G no larger than the rows of all (at a few positions G
    # is the larger: H3's --per-ref, 16 calls' at once, was 1.3x a backward's peak)
    step = max(1, min(CHUNK_ELEMENTS, s.numel() + a.numel()) // (batch * p))
    out = []
    for lo in range(0, len(refs), step):
        hi = min(lo + step, len(refs))
        part, side = s[lo * batch : hi * batch], a[lo * batch : hi * batch]
        g = (part.transpose(-1, -2) @ side).view(hi - lo, batch, p)  # (c*B, G, O, I): (c, B, P)
        out += [_dots(g[c], rows(r.to(g.dtype))) for c, r in enumerate(refs[lo:hi])]
        del g  # let go before the next calls' is formed
    return torch.stack(out)
