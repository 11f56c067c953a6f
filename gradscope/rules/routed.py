"""The fused 3-D weight of routed experts, read by ``grouped_mm`` on rows whose examples and
experts the batch's values pick.

Row s of a call is example ``own[s]``'s token, run by expert ``expert[s]`` (the group of the
call's ``offs`` it falls in; a row past the last group runs no expert). Example b's gradient
of expert e's (O, I) matrix is G_be = sum over its rows s of s_s a_s^T, so

    ||G_b||^2 = sum over pairs of rows (s, t) of b run by one expert of (s_s . s_t)(a_s . a_t):

the Gram route over rows, masked to pairs of one key (example, expert), in chunks of rows,
where that costs little beside the read (``gram_cheap``). Where it costs more (many rows on wide
experts: Mixtral's), the rows sorted by key and each key's G_be formed or its own Gram taken,
the keys' counts read on the host (one sync for a layer's reads of one offsets, as the weight
gradient's ``grouped_mm`` that the pass skips reads them): a training step sums the G formed,
and the rows of keys of few rows in one product an expert (``keyed.keyed_sums``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .base import CHUNK_ELEMENTS, Contribution, Dense, _acc, _cat, _sq_norm, stacked
from .keyed import experts_of, gram_sq, key_counts, keyed_sums

# the Gram of S rows over every pair costs S^2 (in + out), the read S in out: the Gram where the
# first is at most this many times the second, or this few in all, else each key's rows apart
ROUTED_COST, ROUTED_FLOPS = 4, 1 << 24


def gram_cheap(rows: int, shape: torch.Size) -> bool:
    """Whether the Gram of ``rows`` rows of a (E, a, b) expert weight costs at most
    ``ROUTED_COST`` times the rows' product with it, or ``ROUTED_FLOPS``."""
    a, b = shape[-2], shape[-1]
    return rows * (a + b) <= ROUTED_COST * a * b or rows * rows * (a + b) <= ROUTED_FLOPS


class Routed(Contribution):
    """G_b = sum over b's rows s of s_s a_s^T at ``W[expert[s]]`` (``a_s s_s^T`` where the
    weight is (E, I, O), ``transposed``). ``a`` (S, I) inputs and ``s`` (S, O) output gradients
    of one or more calls, ``own`` (S,) each row's example of
    ``batch``, ``expert`` (S,) each row's expert (E: none; its output gradient is then zero).
    Made as it is where each row's expert is known (``F.linear(x, W[e])``, ``x @ W[e]``);
    ``one``: ``shape`` is one Linear's weight's (O, I) or bias's (O,), read whole on rows whose
    examples the values pick (a Linear called inside a routed region), a stack of one expert."""

    def __init__(
        self,
        a: Tensor,
        s: Tensor,
        own: Tensor,
        expert: Tensor,
        shape: torch.Size,
        batch: int,
        transposed: bool,
        one: bool = False,
        past: bool = False,
    ):
        self.a, self._s, self.own, self.expert = _acc(a), _acc(s), own, expert
        self._past = past  # rows of no expert (E) may hold output gradients: ``s`` zeroes them
        self.param, self.one = torch.Size(shape), one  # the parameter's shape
        self.shape = torch.Size((1, *shape)) if one else self.param  # (E, *W[e])
        self.batch, self.transposed = batch, transposed
        self.key = own * self.shape[0] + expert.clamp(max=self.shape[0] - 1)
        self.keyed = not gram_cheap(self.a.shape[0], self.shape)  # each key's rows apart
        self.offs: Tensor | None = None  # the grouped product's (``of``): its keys' counts shared

    @classmethod
    def of(
        cls,
        a: Tensor,
        s: Tensor,
        own: Tensor,
        offs: Tensor,
        shape: torch.Size,
        batch: int,
        transposed: bool = False,
    ) -> Routed:
        """One ``grouped_mm(a, W or W^T, offs)`` call's contribution from its output gradient:
        rows past the last group (the kernel skips them) in no key, ``s`` zero there."""
        part = cls(a, s, own, experts_of(offs, a.shape[0]), shape, batch, transposed, past=True)
        part.offs = offs
        return part

    @property
    def s(self) -> Tensor:
        """(S, O) the rows' output gradients, zero at rows of no expert: zeroed once asked
        for, as ``keyed`` answers never ask (their keys hold no such row; a copy of W9's
        output gradients, 2% of its watched step)."""
        if self._past:
            live = (self.expert < self.shape[0])[:, None]
            self._s, self._past = torch.where(live, self._s, 0), False
        return self._s

    @property
    def one_gram(self) -> bool:
        """Whether its norm takes one Gram of its rows, no chunks: ``routed_norms`` answers
        several such together."""
        return not self.keyed and self.a.shape[0] ** 2 <= CHUNK_ELEMENTS

    def forms(self, *, train: bool) -> bool:
        """Whether a training step's norms and batch sum form each key's G: where ``keyed``,
        its sum then costs a sum beside the forming, which replaces autograd's product."""
        return train and self.keyed

    def _keys(self, experts: bool = False) -> Iterator[tuple[int, Tensor, Tensor]]:
        """(key, left, right) of each key that holds rows (an expert, where ``experts``), its
        rows' (n, *) sides such that G = left^T right, rows of no expert in none: the keys'
        counts read on the host (the one sync, shared: ``keyed.key_counts``), each key's rows
        gathered as it comes, into copies the cache holds for its product (gathered at once,
        through memory: 10% more)."""
        by, counts = self._counts(experts)
        left, right = (self.a, self._s) if self.transposed else (self._s, self.a)
        order = torch.argsort(by, stable=True)  # (S,) the rows by key
        lo = 0
        for k, n in enumerate(counts):
            if n:
                rows = order[lo : lo + n]
                yield k, left.index_select(0, rows), right.index_select(0, rows)
                lo += n

    def _counts(self, experts: bool = False) -> tuple[Tensor, list[int]]:
        """(S,) each row's key (its expert, where ``experts``; past every key for a row of no
        expert) and how many rows each key holds, on the host (``keyed.key_counts``)."""
        e, apart = self.shape[0], self._past and not experts
        keys = e if experts else self.batch * e
        by = self.expert if experts else self.key
        if apart:  # rows of no expert past every key
            by = torch.where(self.expert < e, by, keys)
        form = (e, self.batch, experts, apart, len(by))
        return by, key_counts(by, keys, self.offs, self.own, form)

    def _keyed_norms(self) -> Tensor:
        """(B,) norms from each key's rows: its Gram where that costs less than forming its
        G (n^2 (in + out) against n in out), else its G formed."""
        e, (o, i) = self.shape[0], self.shape[1:]
        at, each = [], []
        for k, left, right in self._keys():
            n = left.shape[0]
            if n * (o + i) < o * i:  # (n, n) Grams of both sides, multiplied and summed
                each.append(gram_sq(left, right))
            else:
                each.append(_sq_norm((left.T @ right).view(1, -1)))
            at.append(k // e)
        return self._per_example(at, each)

    def _per_example(self, at: list[int], each: list[Tensor]) -> Tensor:
        """(B,) the keys' squared norms ``each`` (1,) added up at their examples ``at``."""
        out = self._s.new_zeros(self.batch)
        if not at:
            return out
        return out.index_add_(0, torch.tensor(at, device=out.device), torch.cat(each))

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        """Where ``keyed``: each key's G formed once, or its Gram taken where it holds few
        rows, and each expert's sum (``keyed.keyed_sums``)."""
        if not self.keyed:
            return super().norm_sq_and_sum()
        by, counts = self._counts()
        left, right = (self.a, self._s) if self.transposed else (self._s, self.a)
        at, each, total = keyed_sums(left, right, by, counts, self.batch)
        return self._per_example(at, each), total.view(self.param)

    def batch_sum(self) -> Tensor:
        """Each expert's sum over its rows, left^T right: no example's G formed."""
        total = self._s.new_zeros(self.shape)  # (E, *W[e])
        for k, left, right in self._keys(experts=True):
            total[k] = left.T @ right
        return total.view(self.param)

    def norm_sq(self) -> Tensor:
        if self.keyed:
            return self._keyed_norms()
        n = self.a.shape[0]
        out = self.s.new_zeros(self.batch)
        step = max(1, CHUNK_ELEMENTS // max(n, 1))
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            same = self.key[lo:hi, None] == self.key[None, :]
            pairs = (self.s[lo:hi] @ self.s.T) * (self.a[lo:hi] @ self.a.T) * same
            out.index_add_(0, self.own[lo:hi], pairs.sum(1))
        return out

    def inner(self, refs: Tensor) -> Tensor:
        """sum over b's rows of s_s^T R[expert] a_s (a_s^T R[expert] s_s, transposed): on the
        CPU each row by its own expert's matrix (``routed_inners``); elsewhere every expert's
        product with a row by one matrix product, each row's own expert's picked."""
        if self.sorted_route:
            return routed_inners([self], refs[None])[0]
        k, e = len(refs), self.shape[0]
        left, right = (self.a, self.s) if self.transposed else (self.s, self.a)
        width = left.shape[1]
        r = refs.to(self.a.dtype).reshape(k * e * width, right.shape[1])
        out, n = self.s.new_zeros(k, self.batch), right.shape[0]
        step = max(1, CHUNK_ELEMENTS // max(k * e * width, 1))
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            every = (right[lo:hi] @ r.T).view(hi - lo, k, e, width)
            mine = every[torch.arange(hi - lo), :, self.key[lo:hi] % e]  # (rows, K, width)
            out.index_add_(1, self.own[lo:hi], (mine * left[lo:hi, None]).sum(-1).T)
        return out.T

    @property
    def sorted_route(self) -> bool:
        """Whether ``routed_inners`` answers its inner products: on the CPU, in float32, on
        widths ``grouped_mm`` takes (rows of 16 bytes). Not on CUDA, whose ``grouped_mm`` in
        float32 reads the group offsets on the host: a sync per read."""
        right = self.s if self.transposed else self.a
        return (
            self.s.device.type == "cpu"
            and self.s.dtype == torch.float32
            and right.shape[1] % 4 == 0
        )

    def materialize(self) -> Tensor:
        left, right = (self.a, self.s) if self.transposed else (self.s, self.a)
        outer = left[:, :, None] * right[:, None, :]  # (S, *W[e])
        grads = outer.new_zeros(self.batch * self.shape[0], *outer.shape[1:])
        return grads.index_add_(0, self.key, outer).view(self.batch, *self.param)

    def examples(self, lo: int, hi: int) -> Contribution:
        """Examples lo to hi - 1: the other examples' rows kept with zero output gradients
        (cutting them out would read the batch's values on the host)."""
        mine = (self.own >= lo) & (self.own < hi)
        s, own = torch.where(mine[:, None], self.s, 0), torch.where(mine, self.own - lo, 0)
        return Routed(self.a, s, own, self.expert, self.param, hi - lo, self.transposed, self.one)

    def merge(self, other: Contribution) -> Contribution:
        """Two calls' rows together: the Gram's pairs across them are the cross terms."""
        same = (self.param, self.batch, self.transposed, self.one)
        if (
            isinstance(other, Routed)
            and (other.param, other.batch, other.transposed, other.one) == same
        ):
            return Routed(
                torch.cat([self.a, other.a]),
                torch.cat([self.s, other.s]),
                torch.cat([self.own, other.own]),
                torch.cat([self.expert, other.expert]),
                *same,
            )
        return Dense(self.materialize() + other.materialize())


def routed_norms(parts: Sequence[Routed]) -> Tensor:
    """(n, B) ``norm_sq`` of n ``one_gram`` Routed of one shape (rows, widths, experts, batch),
    in one batched product: the routed reads of a backward's layers answered together, as
    ``ghost.gram_norms`` answers Outers."""
    a = torch.stack([p.a for p in parts])  # (n, S, I)
    s = torch.stack([p.s for p in parts])  # (n, S, O)
    key = torch.stack([p.key for p in parts])  # (n, S)
    same = key[:, :, None] == key[:, None, :]
    pairs = ((s @ s.mT) * (a @ a.mT) * same).sum(2)  # (n, S): row s's terms with its own key
    own = torch.stack([p.own for p in parts])
    return s.new_zeros(len(parts), parts[0].batch).scatter_add_(1, own, pairs)


def routed_inners(parts: Sequence[Routed], refs: Sequence[Tensor]) -> Tensor:
    """(n, B, K) ``inner`` of n Routed of one shape and batch, each with its own references
    ``refs``, n (K, *shape) (a list, or one tensor stacked), where each ``sorted_route``:
    every row by its own expert's matrix only, one ``grouped_mm`` per reference over the rows
    of all n sorted by (read, expert), where the product with every expert would cost E times
    the work. A row of no expert has a zero output gradient (``Routed.of``): it runs the last
    expert, as ``key`` places it, for a zero."""
    n, k, (e, *_), b = len(parts), refs[0].shape[0], parts[0].shape, parts[0].batch
    transposed = parts[0].transposed
    left = _cat([p.a if transposed else p.s for p in parts])  # (n*S, width)
    right = _cat([p.s if transposed else p.a for p in parts])  # (n*S, right)
    width = left.shape[1]
    shape = (n * e, width, right.shape[1])
    group = _cat([j * e + p.key % e for j, p in enumerate(parts)])  # (n*S,)
    own = _cat([j * b + p.own for j, p in enumerate(parts)])
    order = torch.argsort(group, stable=True)
    left, right, own = left[order], right[order], own[order]
    ends = torch.bincount(group, minlength=n * e).cumsum(0).to(torch.int32)  # each group's end
    out, rows = left.new_zeros(n * b, k), len(order)
    step = max(1, CHUNK_ELEMENTS // max(width, 1))  # rows at a time: (rows, width) bound
    chunks = [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]
    offs = [(ends - lo).clamp(0, hi - lo) for lo, hi in chunks]  # the groups' ends in each
    for j in range(k):
        # reference j's (n*E, right, width), column-major: a view where K is 1, else copied
        # one reference at a time (all K with K inside them: H4's --per-ref pass, R = 8, 27 ms
        # of 86; each one's blocks copied, all held at once: 7 MiB there, its peak doubled)
        r = _reference(refs, j).to(left.dtype).reshape(shape).mT
        for (lo, hi), off in zip(chunks, offs, strict=True):
            mine = torch._grouped_mm(right[lo:hi], r, offs=off) * left[lo:hi]  # (rows, width)
            out[:, j].index_add_(0, own[lo:hi], mine.sum(-1))
        del r  # let go before the next reference's copy is made
    return out.view(n, b, k)


def _reference(refs: Sequence[Tensor], j: int) -> Tensor:
    """(n, *shape) the n calls' j-th references: a view of a stacked tensor's, or of one
    reference each laid out stacked (``base.stacked``); else the j-th of each stacked."""
    if isinstance(refs, Tensor) or refs[0].shape[0] == 1:
        return stacked(refs)[:, j]
    return torch.stack([r[j] for r in refs])
