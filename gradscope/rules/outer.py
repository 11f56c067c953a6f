"""The weight of Linear and Conv layers: G_i = sum_t s_it a_it^T, kept as its factors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .base import (
    CHUNK_ELEMENTS,
    Contribution,
    Once,
    _acc,
    _cat,
    _dots,
    _sq_norm,
    rows,
    stacked,
)
from .formed import formed_inners, formed_sums
from .ghost import ghost_inner, gram_norm_sq
from .projection import Projection

# Examples with at least this share of their group's longest row count share its padded
# product (``Outer.lengths``): the padding then costs at most a quarter more than their rows.
SIMILAR = 0.8
# Forming a large G (at least ``LARGE`` elements an example) makes each example's O x I matrix
# from sums of only T products, which run a few times slower a product than the Gram's long
# dot products, then reads it again for its norm (T 40, O 10240, I 32 in float64: 7 ms against
# 3.6 for the Gram's 25% more products): it is counted at ``FORMING`` more positions. A small
# one costs its dispatch more than its products: counted as they are.
LARGE, FORMING = 1 << 16, 32


class Outer(Contribution):
    """G_i = sum_t s_it a_it^T for each of ``G`` groups: the weight of Linear and Conv layers.

    ``s`` is (B, G, T, O) output gradients and ``a`` is (B, G, T, I) inputs at T positions; the
    parameter, of ``shape``, is the (G*O, I) matrix stacked group by group and reshaped.

    ``lengths`` says, where examples hold different numbers of rows padded with zeros to the
    longest (the tokens routed to one expert, gathered per example), that example i's positions
    from ``lengths[i]`` on are zeros. Examples of similar length are then answered together, cut
    to their group's longest, each group by its cheaper route: padding every example to the
    longest would cost the longest's work for each. ``trimmed``: those zeros are rows of a
    product autograd takes whole, cut off (``trailing.py``), so that a training step's batch
    sum over the rows left costs less than autograd's over them all.
    """

    def __init__(
        self,
        s: Tensor,
        a: Tensor,
        shape: torch.Size,
        lengths: Sequence[int] | None = None,
        sq: Once | None = None,
        trimmed: bool = False,
    ):
        self.s, self.a, self.shape = _acc(s), _acc(a), torch.Size(shape)
        self.sq = sq  # (B,) ||s_i||^2 of one position and group, shared with a bias (``Once``)
        full = lengths is None or all(n == self.s.shape[2] for n in lengths)
        self.lengths = None if full else tuple(int(n) for n in lengths)
        self.trimmed = trimmed and not full
        self._grouped: list[tuple[Tensor, Outer]] | None = None

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        (b, g, t, o), i = self.s.shape, self.a.shape[-1]
        return b, g, t, o, i

    def merge(self, other: Contribution) -> Contribution:
        b, g, _, o, i = self.dims
        if isinstance(other, Outer) and (b, g, o, i) == tuple(other.dims[k] for k in (0, 1, 3, 4)):
            # positions of both calls add up: concatenate them, cross terms come out of the Gram
            return Outer(
                torch.cat([self.s, other.s], 2),
                torch.cat([self.a, other.a], 2),
                self.shape,
                self._merged_lengths(other),
                trimmed=self.trimmed or other.trimmed,
            )
        return super().merge(other)

    def _merged_lengths(self, other: Outer) -> tuple[int, ...] | None:
        """Where each example's rows end once ``other``'s positions follow this one's."""
        if self.lengths is None and other.lengths is None:
            return None
        t = self.dims[2]
        mine = self.lengths or (t,) * self.dims[0]
        theirs = other.lengths or (other.dims[2],) * self.dims[0]
        return tuple(t + m if m else n for n, m in zip(mine, theirs, strict=True))

    def _groups(self) -> list[tuple[Tensor, Outer]] | None:
        """(example indices, their Outer cut to their longest) for each group of examples of
        similar length; examples with no rows are in none. None where every example may hold
        all T positions."""
        if self.lengths is None:
            return None
        if self._grouped is None:
            groups: list[list[int]] = []
            for i in sorted(range(self.dims[0]), key=lambda i: -self.lengths[i]):
                if self.lengths[i] == 0:
                    break
                if groups and self.lengths[i] >= SIMILAR * self.lengths[groups[-1][0]]:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            self._grouped = [self._cut(group) for group in groups]
        return self._grouped

    def _cut(self, group: list[int]) -> tuple[Tensor, Outer]:
        """The examples of ``group`` (longest first) cut to the longest: a view where they are
        consecutive examples (one alone, as routing that sends an expert one example's tokens
        makes many), else a gather."""
        n, group = self.lengths[group[0]], sorted(group)
        lo, hi = group[0], group[-1] + 1
        index = torch.tensor(group, device=self.s.device)
        pick = slice(lo, hi) if hi - lo == len(group) else index
        return index, Outer(self.s[pick, :, :n], self.a[pick, :, :n], self.shape)

    def _placed(self, answer: Callable[[Outer], Tensor], tail: Sequence[int]) -> Tensor:
        """(B, *tail): ``answer`` of each group at its examples' rows, zeros where none."""
        out = self.s.new_zeros(self.dims[0], *tail)
        for index, part in self._groups():
            out[index] = answer(part)
        return out

    def examples(self, lo: int, hi: int) -> Contribution:
        lengths = None if self.lengths is None else self.lengths[lo:hi]
        return Outer(self.s[lo:hi], self.a[lo:hi], self.shape, lengths, trimmed=self.trimmed)

    def norm_sq(self) -> Tensor:
        b, g, t, o, i = self.dims
        if self._groups() is not None:
            return self._placed(Outer.norm_sq, ())
        if t == 1 and self.sq is not None:  # ||s||^2 its bias's too: computed once for both
            return _sq_norm(self.a).view(b) * self.sq()
        if t == 1:  # ||s a^T||^2 = ||s||^2 ||a||^2; one group's (B, 1, 1) viewed, not summed
            each = _sq_norm(self.s) * _sq_norm(self.a)
            return each.view(b) if g == 1 else each.sum((1, 2))
        if self._gram_cheaper:
            return gram_norm_sq(self.s, self.a)
        return _cat(self._formed(lambda m: _sq_norm(m.flatten(1))))

    def forms(self, *, train: bool) -> bool:
        """Whether answering forms each example's G. ``train`` (``Want.train``) asks a training
        step's question, its norms and batch sum (``norm_sq_and_sum``): where the Gram norm,
        sum_i T_i^2 (I + O), costs more than the sum of B * O * I that forming adds to the
        batch gradient's product it leaves to autograd (each example's own rows and length,
        where ``lengths``). Else the norms' alone (``norm_sq``): all positions of every
        example, more than one, and no Gram cheaper (many positions, a sequence model's).
        ``trimmed``: a training step's sum is the rule's either way, over the rows left."""
        return (train and self.trimmed) or self._forming(train)

    def _forming(self, train: bool) -> bool:
        _, _, t, o, i = self.dims
        if not train:
            return self.lengths is None and t > 1 and not self._gram_cheaper
        if self.lengths is not None:
            return o * i * len(self.lengths) < sum(n * n for n in self.lengths) * (i + o)
        return t > 1 and o * i < t * t * (i + o)

    def norm_sq_and_sum(self) -> tuple[Tensor, Tensor]:
        """The squared norms and the batch sum from the same G formed, where a training step
        forms it (``formed.py``): the sum over a chunk's examples costs B * O * I beside
        their forming, not the batch gradient's B * T * O * I again."""
        if not self._forming(train=True):
            return super().norm_sq_and_sum()
        return formed_sums(self.s, self.a, self.lengths, self.shape)

    @property
    def _gram_cheaper(self) -> bool:
        """Whether the (T, T) Gram matrices, T^2 (I + O), cost less than forming G, T O I
        (``FORMING`` more positions counted for a large G)."""
        _, _, t, o, i = self.dims
        more = FORMING if o * i >= LARGE else 0
        return t * t * (i + o) < (t + more) * i * o

    def norm_sq_and_inner(self, refs: Tensor) -> tuple[Tensor, Tensor]:
        """Where the norm forms G anyway (many positions, as an LM head over a sequence), the
        inner products come from the same chunks for (B, K, P) more, instead of sum_t s^T R a;
        where the inner products form it (``_formed_cheaper``), the norms do, for (B, P) more."""
        if (groups := self._groups()) is not None:
            norms, inners = (
                self.s.new_zeros(self.dims[0]),
                self.s.new_zeros(self.dims[0], len(refs)),
            )
            for index, part in groups:
                norms[index], inners[index] = part.norm_sq_and_inner(refs)
            return norms, inners
        if not self.forms(train=False) and not self._formed_cheaper(len(refs)):
            return self.norm_sq(), self.inner(refs)
        r = rows(refs.to(self.s.dtype))  # (K, P)
        pairs = self._formed(lambda m: (_sq_norm(m.flatten(1)), _dots(m.flatten(1), r)))
        return _cat([n for n, _ in pairs]), _cat([d for _, d in pairs])

    @property
    def one_gram(self) -> bool:
        """Whether the norm is one (T, T) Gram block per example and group: a T > 1 of all
        positions for every example, cheaper than forming G, small enough for one block."""
        b, g, t, _, _ = self.dims
        return (
            self.lengths is None
            and t > 1
            and self._gram_cheaper
            and b * g * t * t <= CHUNK_ELEMENTS
        )

    def _formed(self, fn: Callable[[Tensor], Any], limit: int = CHUNK_ELEMENTS) -> list:
        """``fn`` of each example's G_i, a few examples at a time, (b, G, O, I) of no more than
        ``limit`` elements, each let go before the next is formed."""
        b, g, _, o, i = self.dims
        step = max(1, limit // (g * o * i))
        # (b, G, O, T) @ (b, G, T, I) -> (b, G, O, I)
        return [fn(self.s[lo : lo + step].mT @ self.a[lo : lo + step]) for lo in range(0, b, step)]

    def materialize(self) -> Tensor:
        if self._groups() is not None:
            return self._placed(Outer.materialize, self.shape)
        return torch.cat(self._formed(lambda m: m)).reshape(-1, *self.shape)

    def project(self, p: Projection) -> Tensor:
        """Both sides projected, then summed over the positions, where the projection reads
        the parameter as this Outer's (G*O, I) matrix; else from G formed, in chunks."""
        if self._groups() is not None:
            return self._placed(lambda part: part.project(p), (p.dim,))
        _, g, _, o, i = self.dims
        if (p.rows, p.cols) == (g * o, i):
            return p.factored(self.s, self.a)
        return _cat(self._formed(p.dense))

    def batch_sum(self) -> Tensor:
        if self._groups() is not None:
            return sum((p.batch_sum() for _, p in self._groups()), self.s.new_zeros(self.shape))
        b, g, t, o, i = self.dims
        s, a = (
            self.s.transpose(0, 1).reshape(g, b * t, o),
            self.a.transpose(0, 1).reshape(g, b * t, i),
        )
        return (s.transpose(1, 2) @ a).reshape(self.shape)  # (G, O, B*T) @ (G, B*T, I)

    def _formed_cheaper(self, k: int) -> bool:
        """Whether K inner products cost less from each G_i formed (T + K products of the
        parameter's size per example) than through R (T * K): several positions and several
        references, as ``--per-ref`` over a sequence model's layers."""
        t = self.dims[2]
        return t * k > t + k

    def inner(self, refs: Tensor) -> Tensor:
        if self._groups() is not None:
            return self._placed(lambda p: p.inner(refs), (refs.shape[0],))
        b, g, t, o, i = self.dims
        if self._formed_cheaper(refs.shape[0]):  # G formed, a few examples at a time
            r = rows(refs.to(self.s.dtype))  # (K, P)
            # no more of G at once than the rows of all, as ``formed_inners`` (T1's --per-ref,
            # every example's at once, was 1.21x a backward's peak)
            limit = min(CHUNK_ELEMENTS, self.s.numel() + self.a.numel())
            return _cat(self._formed(lambda m: _dots(m.flatten(1), r), limit))
        r = refs.to(self.s.dtype).reshape(-1, g, o, i)  # (K, G, O, I)
        # sum_t s_t^T R a_t: project the inputs through R, never forming G; a few references at
        # a time, so that --per-ref's K of up to 1000 holds no (B, K, G, T, O) product at once
        step = max(1, CHUNK_ELEMENTS // (b * g * t * min(o, i)))
        if step >= r.shape[0]:  # one product, no chunk to join
            return self._inner(r)
        return _cat([self._inner(r[lo : lo + step]) for lo in range(0, r.shape[0], step)], 1)

    def inners(self, refs: Sequence[Tensor], batch: int) -> Tensor:
        if self.lengths is not None:
            return super().inners(refs, batch)
        if self._formed_cheaper(refs[0].shape[0]):
            return formed_inners(self.s, self.a, self.shape, refs, batch)
        refs = stacked(refs)
        n, k = refs.shape[:2]
        _, g, t, o, i = self.dims
        r = refs.to(self.s.dtype).reshape(n, k, g, o, i)
        # as ``inner``, a few references at a time: each call's examples through its own
        step = max(1, CHUNK_ELEMENTS // (n * batch * g * t * min(o, i)))
        return _cat([self._inners(r[:, lo : lo + step], batch) for lo in range(0, k, step)], 2)

    def _inners(self, r: Tensor, batch: int) -> Tensor:
        n, (_, g, t, o, i) = r.shape[0], self.dims
        return ghost_inner(r, self.s.reshape(n, batch, g, t, o), self.a.reshape(n, batch, g, t, i))

    def _inner(self, r: Tensor) -> Tensor:
        return ghost_inner(r, self.s, self.a)
