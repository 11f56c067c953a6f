"""nn.Embedding: rows hit by the same token in one example add up; cost free of vocabulary size
(``Rows``, which nn.EmbeddingBag's rule shares: ``embedding_bag.py``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import CHUNK_ELEMENTS, Contribution, _acc
from .outer import Outer
from .projection import Projection
from .registry import register_rule

# Up to this many positions an example's squared norm is its Gram of output gradients masked to
# the pairs of positions that look up one row: four ops against the sort's sixteen, 2-3.5x faster
# at T 8-32 on a CPU core, even at T 64, slower past it as the (T, T) products grow
GRAM_POSITIONS = 32


def example_keys(ids: Tensor, num_rows: int) -> Tensor:
    """(B*T,) one key per (example, row) pair: equal keys are the same row in the same example."""
    b = ids.shape[0]
    return (torch.arange(b, device=ids.device).unsqueeze(1) * num_rows + ids).flatten()


def _groups(keys: Tensor) -> Tensor:
    """(N,) for each key, the index of its group of equal keys: ``torch.unique``'s inverse, by a
    sort that leaves the group count on the device (unique's output shape would wait for it: a
    host-device sync on every batch). Groups are numbered in key order, fewer than N."""
    ordered, order = keys.sort()
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group = starts.cumsum(0) - 1  # (N,) of the sorted keys
    return torch.empty_like(group).scatter_(0, order, group)


class Rows(Contribution):
    """G_i[v] = sum of s_it over the positions t where example i looks up row v.

    ``ids`` is (B, T) row indices and ``s`` (B, T, D) output gradients at those positions; the
    parameter is the (num_rows, D) table, never formed per example unless asked. ``share``,
    (B, T) where a row's gradient is divided by its count (``scale_grad_by_freq``): each
    position's count in its example over its count in the batch, by which the batch gradient
    (autograd's, divided by the batch's counts) weighs the examples' gradients.
    """

    def __init__(self, ids: Tensor, s: Tensor, num_rows: int, share: Tensor | None = None):
        self.ids, self.s, self.share = ids, _acc(s), share
        self.shape = torch.Size((num_rows, s.shape[-1]))

    def examples(self, lo: int, hi: int) -> Contribution:
        share = None if self.share is None else self.share[lo:hi]
        return Rows(self.ids[lo:hi], self.s[lo:hi], self.shape[0], share)

    def norm_sq(self) -> Tensor:
        b, t, d = self.s.shape
        if t <= GRAM_POSITIONS:
            # ||G_i||^2 = sum over positions t, u looking up one row of s_t . s_u
            same = self.ids.unsqueeze(2) == self.ids.unsqueeze(1)  # (B, T, T)
            return (self.s @ self.s.transpose(1, 2)).mul_(same).sum((1, 2))
        keys = example_keys(self.ids, self.shape[0])
        group = _groups(keys)
        # each distinct (example, row): the sum of its positions' gradients; B*T slots, those
        # past the groups' count stay zero
        rows = self.s.new_zeros(b * t, d).index_add_(0, group, self.s.reshape(-1, d))
        example = torch.zeros_like(keys).scatter_(0, group, keys // self.shape[0])  # each slot's
        return self.s.new_zeros(b).index_add_(0, example, rows.pow(2).sum(1))

    def inner(self, refs: Tensor) -> Tensor:
        refs = refs.to(self.s.dtype)
        step = max(1, CHUNK_ELEMENTS // self.s.numel())  # references at a time: (k, B, T, D)
        # the reference rows each position looked up, against its output gradient, summed by a
        # cascade rather than a matrix product's inner dim (``base.BLOCK``)
        return torch.cat(
            [
                (refs[lo : lo + step, self.ids] * self.s).flatten(2).sum(2).T  # (k, B, T, D)
                for lo in range(0, refs.shape[0], step)
            ],
            1,
        )  # (B, K)

    def materialize(self) -> Tensor:
        b, _, d = self.s.shape
        keys = example_keys(self.ids, self.shape[0])
        grads = self.s.new_zeros(b * self.shape[0], d).index_add_(0, keys, self.s.reshape(-1, d))
        return grads.view(b, *self.shape)  # (B, V, D)

    def project(self, p: Projection) -> Tensor:
        """sum_t P_out[id_t]^T (P_in^T s_t): each position's row of P_out gathered, never G_i."""
        if (p.rows, p.cols) != tuple(self.shape) or p.out is None:
            return super().project(p)  # every row kept: a small table, formed
        b = self.s.shape[0]
        s = self.s if p.inn is None else self.s @ p.inn.to(self.s.dtype)  # (B, T, k_in)
        looked_up = p.out.to(s.dtype)[self.ids]  # (B, T, k_out)
        return (looked_up.transpose(1, 2) @ s).reshape(b, -1)  # (B, k_out, T) @ (B, T, k_in)

    def batch_sum(self) -> Tensor:
        d = self.s.shape[-1]
        s = self.s if self.share is None else self.s * self.share.unsqueeze(-1)
        return self.s.new_zeros(self.shape).index_add_(0, self.ids.flatten(), s.reshape(-1, d))

    def cross(self, other: Contribution) -> Tensor | None:
        """With an output head tied to this table (an ``Outer`` of the same shape):
        <G_i, H_i> = sum_{t,u} (s_t . a_u) s'_u[id_t], never forming either gradient."""
        if not isinstance(other, Outer) or other.dims[1] != 1 or other.shape != self.shape:
            return None
        b, _, u, _, _ = other.dims
        t = self.ids.shape[1]
        head_s, head_a = other.s[:, 0], other.a[:, 0]  # (B, U, V) logit grads, (B, U, D) inputs
        step = max(1, CHUNK_ELEMENTS // (b * t))
        total = self.s.new_zeros(b)
        for lo in range(0, u, step):
            dots = self.s @ head_a[:, lo : lo + step].transpose(1, 2)  # (B, T, u) s_t . a_u
            ids = self.ids[:, None, :].expand(b, dots.shape[2], t)
            picked = head_s[:, lo : lo + step].gather(2, ids)  # (B, u, T) s'_u[id_t]
            total += (dots * picked.transpose(1, 2)).sum((1, 2))
        return total

    def merge(self, other: Contribution) -> Contribution:
        if isinstance(other, Rows) and other.shape == self.shape:
            # a second lookup into the same table: its positions join the first call's
            share = None
            if self.share is not None or other.share is not None:
                share = torch.cat([self._share(), other._share()], 1)
            ids, s = torch.cat([self.ids, other.ids], 1), torch.cat([self.s, other.s], 1)
            return Rows(ids, s, self.shape[0], share)
        return super().merge(other)

    def _share(self) -> Tensor:
        return torch.ones_like(self.ids, dtype=self.s.dtype) if self.share is None else self.share


def _rows(module: nn.Embedding) -> int | None:
    """Row by row, but for counts of a row within an example (scale_grad_by_freq)."""
    return None if module.scale_grad_by_freq else 0


@register_rule(nn.Embedding, name="embedding", rows=_rows)
def embedding(
    module: nn.Embedding, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    return {
        "weight": lookup(
            inputs[0], grad_output, module.num_embeddings, module.padding_idx,
            module.scale_grad_by_freq,
        )
    }  # fmt: skip


def lookup(
    ids: Tensor, grad_output: Tensor, num_rows: int, padding_idx: int | None, by_freq: bool
) -> Rows:
    """The table's contribution from ``F.embedding(ids, table)`` and its output gradient."""
    b = grad_output.shape[0]
    ids = ids.reshape(b, -1)  # (B, T) any index rank flattens to positions
    s = grad_output.reshape(b, -1, grad_output.shape[-1])  # (B, T, D)
    if padding_idx is not None:
        s = s * (ids != padding_idx % num_rows).unsqueeze(-1)  # the padding row gets no gradient
    return by_count(ids, s, num_rows) if by_freq else Rows(ids, s, num_rows)


def by_count(ids: Tensor, s: Tensor, num_rows: int, member: Tensor | None = None) -> Rows:
    """``scale_grad_by_freq``'s rows: the loop sees one example at a time, so a position's
    gradient is divided by its row's count in its example; autograd's batch gradient by its
    count in the batch, by which ``share`` weighs it. A position ``member`` marks False (past
    a bag's end) counts for no row."""
    b = ids.shape[0]  # (B, T) ids, (B, T, D) s
    keys = ids if member is None else torch.where(member, ids, num_rows)  # no row of the table
    own, batch = _counts(example_keys(keys, num_rows + 1)), _counts(keys.flatten())  # (B*T,)
    s = s / own.view(b, -1, 1).to(s.dtype)
    return Rows(ids, s, num_rows, (own.to(s.dtype) / batch.to(s.dtype)).view(b, -1))


def _counts(keys: Tensor) -> Tensor:
    """(N,) how many of ``keys`` equal each one."""
    group = _groups(keys)
    return torch.zeros_like(group).index_add_(0, group, torch.ones_like(group))[group]
