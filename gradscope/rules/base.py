"""Per-example gradients in factored form, as the layer rules (``registry.py``) give them.

A Contribution holds one parameter's per-example gradient without forming
it where the layer's structure allows, and answers three questions about it: its squared norm, its
inner product with reference tensors, and (only when nothing cheaper exists) the gradient itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .projection import Projection

# Bound on the elements of one temporary (Gram block, materialised chunk): 2**24 floats = 64 MiB.
CHUNK_ELEMENTS = 1 << 24
# Long sums of products run in blocks of this many terms whose partial sums then add up: the
# CPU's float32 kernels for a norm or a dot product over a long row (``vector_norm``, a matrix
# product's inner dimension) accumulate with an error that grows with its length, 3e-6 relative
# over 200k elements and 2e-4 over 2M, where the loop's gradients are within 1e-7; a block's sum
# stays at float32's rounding, and the blocks' add by a cascade.
BLOCK = 1024
# A row set of at most this many elements takes its squared norms as one product-sum
# (``vecdot``), one call where the fused norm and its square are two: the host-bound passes'
# small layers; its temporary, the size of the rows, is then no matter.
FUSED = 1 << 16


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision models accumulate norms and inner products in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _acc(t: Tensor) -> Tensor:
    # no ``.to`` where the dtype already accumulates: a call per tensor of every rule's parts
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def rows(t: Tensor) -> Tensor:
    """(B, *shape) -> (B, P): one row per example, also for a parameter of shape (); ``t``
    itself where it is (B, P) already (no call for a view of it)."""
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def _sq_norm(t: Tensor) -> Tensor:
    """Squared L2 norm over the last dim: one ``vecdot`` where ``t`` is small (``FUSED``), else
    fused reductions, no squared copy of ``t`` in memory, in ``BLOCK``s where the dim is
    longer."""
    n = t.shape[-1]
    if n <= BLOCK and t.numel() <= FUSED:
        return torch.linalg.vecdot(t, t)
    if n <= BLOCK:
        return torch.linalg.vector_norm(t, dim=-1).square()
    k = n // BLOCK
    head = t[..., : k * BLOCK].unflatten(-1, (k, BLOCK))  # (..., k, BLOCK), a view
    total = torch.linalg.vector_norm(head, dim=-1).square().sum(-1)
    if n % BLOCK:
        total = total + torch.linalg.vector_norm(t[..., k * BLOCK :], dim=-1).square()
    return total


def _dots(x: Tensor, r: Tensor) -> Tensor:
    """(..., B, K) inner products of the rows of ``x`` (..., B, P) with those of ``r``
    (..., K, P), in ``BLOCK``s of P where it is longer."""
    p = x.shape[-1]
    if p <= BLOCK:  # one reference set for all: ``linear``'s x r^T, with no call for r^T
        return torch.nn.functional.linear(x, r) if r.dim() == 2 else x @ r.mT
    k = p // BLOCK
    xb = x[..., : k * BLOCK].unflatten(-1, (k, BLOCK)).movedim(-2, 0)  # (k, ..., B, BLOCK)
    rb = r[..., : k * BLOCK].unflatten(-1, (k, BLOCK)).movedim(-2, 0)  # (k, ..., K, BLOCK)
    total = (xb @ rb.mT).sum(0)  # (k, ..., B, K) -> (..., B, K)
    if p % BLOCK:
        total = total + x[..., k * BLOCK :] @ r[..., k * BLOCK :].mT
    return total


def stacked(refs: Sequence[Tensor]) -> Tensor:
    """(n, K, *shape): n calls' references as one tensor, stacked where they come as a list;
    a view where they already lie stacked, consecutive rows of one tensor in order
    (``engine/backward/stacked.laid_out``), not a copy."""
    if isinstance(refs, Tensor):
        return refs
    first, n = refs[0], len(refs)
    base, at, step = first._base, first.data_ptr(), first.numel()
    shape, dtype, size = first.shape, first.dtype, step * first.element_size()
    if (  # views of one tensor, each contiguous at the address where the one before ends, all
        # within the first's storage: the view reads them (addresses, not storage offsets: views
        # taken before and after ``base.data = ...`` share the base, not the storage)
        n > 1
        and base is not None
        and all(
            t._base is base
            and t.data_ptr() == at + j * size
            and t.shape == shape
            and t.dtype == dtype
            and t.is_contiguous()
            for j, t in enumerate(refs)
        )
        and first.storage_offset() + n * step
        <= first.untyped_storage().nbytes() // first.element_size()
    ):
        return first.as_strided((n, *shape), (step, *first.stride()))
    return torch.stack(list(refs))


def _cat(parts: list[Tensor], dim: int = 0) -> Tensor:
    """``torch.cat`` of fresh results, without its copy where there is one (a small batch's
    one chunk)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class Contribution(ABC):
    """One parameter's per-example gradient, (B, *shape), kept in whatever form is cheapest."""

    shape: torch.Size

    def forms(self, *, train: bool) -> bool:
        """Whether each example's gradient is at hand, or formed (a chunk at a time) by the
        answer to the question asked: with ``train`` (``Want.train``) a training step's, the
        norms and the batch sum, whose sum from the same (``norm_sq_and_sum``) then costs a
        sum, not a matrix product; else the norms alone (``norm_sq``). Here neither."""
        return False

    @abstractmethod
    def norm_sq(self) -> Tensor:
        """(B,) squared L2 norm of each example's gradient."""

    @abstractmethod
    def inner(self, refs: Tensor) -> Tensor:
        """(B, K) inner products of each example's gradient with ``refs`` of shape (K, *shape)."""

    @abstractmethod
    def materialize(self) -> Tensor:
        """(B, *shape) the per-example gradients themselves."""

    def project(self, p: Projection) -> Tensor:
        """(B, p.dim) each example's gradient projected, ``P_out^T G_i P_in`` (see
        ``projection.py``); here from the gradients formed, where no cheaper form exists."""
        return p.dense(self.materialize())

    def batch_sum(self) -> Tensor:
        """(*shape) the sum over examples: the batch gradient of the summed loss."""
        return self.materialize().sum(0)

    def examples(self, lo: int, hi: int) -> Contribution:
        """Examples ``lo`` to ``hi - 1`` alone, formed no further than their own share."""
        return Dense(self.materialize()[lo:hi])

    def merge(self, other: Contribution) -> Contribution:
        """The contribution of both (a module called twice, a weight shared by two modules)."""
        return Dense(self.materialize() + other.materialize())

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        """Both answers at once, for contributions that can share the work between them."""
        return self.norm_sq(), self.inner(refs)

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        """(B,) squared norms and (*shape) the batch sum, from one forming of the examples'
        gradients where ``forms``."""
        return self.norm_sq(), self.batch_sum()

    def inners(self, refs: Sequence[Tensor], batch: int) -> Tensor:
        """(n, batch, K) where this contribution holds the examples of n calls stacked, n *
        batch of them: each call's inner products with its own ``refs``, n (K, *shape) (a
        list, or one (n, K, *shape) tensor: ``stacked``)."""
        return torch.stack(
            [self.examples(k * batch, (k + 1) * batch).inner(r) for k, r in enumerate(refs)]
        )

    def cross(self, other: Contribution) -> Tensor | None:
        """(B,) <G_i, H_i> with ``other``'s per-example gradients, where a form cheaper than
        forming both exists (a tied embedding and output head); None where it does not."""
        return None


class Once:
    """(...) the squared norms of ``t`` (..., N) over its last dim, computed once for the parts
    of one call that each need them: a one-position Linear's output gradient s_i, whose
    ||s_i||^2 is its bias's norm and a factor of its weight's, ||s_i||^2 ||a_i||^2."""

    __slots__ = ("t", "sq")

    def __init__(self, t: Tensor):
        self.t, self.sq = t, None

    def __call__(self) -> Tensor:
        if self.sq is None:
            self.sq, self.t = _sq_norm(self.t), None
        return self.sq


class Dense(Contribution):
    """Per-example gradients formed directly: fine for small parameters (biases, norm scales).
    ``sq``: their squared norms where another part of the call computes them too (``Once``
    over the same (B, P) values)."""

    def forms(self, *, train: bool) -> bool:
        return True

    def __init__(self, grads: Tensor, sq: Once | None = None):
        self.grads = _acc(grads)  # (B, *shape)
        self.shape = grads.shape[1:]
        self.sq = sq

    def norm_sq(self) -> Tensor:
        return _sq_norm(rows(self.grads)) if self.sq is None else self.sq()

    def inner(self, refs: Tensor) -> Tensor:
        return _dots(rows(self.grads), rows(refs.to(self.grads.dtype)))

    def inners(self, refs: Sequence[Tensor], batch: int) -> Tensor:
        refs = stacked(refs)
        n = refs.shape[0]
        own = rows(self.grads).view(n, batch, -1)  # (n, B, P)
        return _dots(own, refs.to(own.dtype).reshape(n, refs.shape[1], -1))  # (n, B, K)

    def materialize(self) -> Tensor:
        return self.grads

    def batch_sum(self) -> Tensor:
        return self.grads.sum(0)

    def examples(self, lo: int, hi: int) -> Contribution:
        return Dense(self.grads[lo:hi])

    def merge(self, other: Contribution) -> Contribution:
        return Dense(self.grads + other.materialize())


class Kinds(Contribution):
    """One parameter's parts of several kinds (a tied table and head) kept apart, as a pass
    that keeps the contributions holds them: what is linear in the gradient adds up, so a
    batch sum or an inner product forms no example's gradient; the norm here forms them (the
    reducer joins the parts' norms through their cross terms instead)."""

    def __init__(self, parts: Sequence[Contribution]):
        self.parts, self.shape = list(parts), parts[0].shape

    def norm_sq(self) -> Tensor:
        return _sq_norm(rows(self.materialize()))

    def inner(self, refs: Tensor) -> Tensor:
        return sum(p.inner(refs) for p in self.parts)

    def materialize(self) -> Tensor:
        return sum(p.materialize() for p in self.parts)

    def project(self, p: Projection) -> Tensor:
        return sum(part.project(p) for part in self.parts)

    def batch_sum(self) -> Tensor:
        return sum(p.batch_sum() for p in self.parts)

    def examples(self, lo: int, hi: int) -> Contribution:
        return Kinds([p.examples(lo, hi) for p in self.parts])
