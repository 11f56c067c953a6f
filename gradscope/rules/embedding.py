"""nn.Embedding: rows hit by the same token in one example add up; cost free of vocabulary size.
nn.EmbeddingBag: the same over each bag's positions, weighted; its max, each column from one row."""

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
    if not by_freq:
        return Rows(ids, s, num_rows)
    # the loop sees one example at a time, so a row is scaled by its count in that example;
    # autograd's batch gradient by its count in the batch
    own, batch = _counts(example_keys(ids, num_rows)), _counts(ids.flatten())  # (B*T,) each
    s = s / own.view(b, -1, 1).to(s.dtype)
    return Rows(ids, s, num_rows, (own.to(s.dtype) / batch.to(s.dtype)).view(b, -1))


def _counts(keys: Tensor) -> Tensor:
    """(N,) how many of ``keys`` equal each one."""
    group = _groups(keys)
    return torch.zeros_like(group).index_add_(0, group, torch.ones_like(group))[group]


def bag_of(offsets: Tensor, n: int, include_last: bool) -> tuple[Tensor, Tensor]:
    """(N,) the bag of each of ``n`` positions cut into bags by ``offsets``, and (bags,) each
    bag's start, as ``F.embedding_bag`` cuts them: bag j from its offset to the next bag's,
    the last to the end (``include_last_offset``: the last offset only counts the bags)."""
    starts = offsets[:-1] if include_last else offsets  # (bags,)
    at = torch.arange(n, device=offsets.device)
    return torch.searchsorted(starts, at, right=True) - 1, starts


def _bags(module: nn.EmbeddingBag, inputs: tuple[Tensor, ...], kwargs: dict):
    """For the engine: a 1-D input's bags (``bag_of``) and their count; None for a (B, L)."""
    offsets = inputs[1] if len(inputs) > 1 else kwargs.get("offsets")
    if inputs[0].dim() != 1 or offsets is None:
        return None
    bag, starts = bag_of(offsets, inputs[0].shape[0], module.include_last_offset)
    return bag, starts.shape[0]


def _padded(
    ids: Tensor, offsets: Tensor, weights: Tensor | None, include_last: bool
) -> tuple[Tensor, Tensor]:
    """(B, L) ids and weights of (N,) ids cut into B bags by ``offsets``, L the longest bag's
    length (read on the host), weight 0 past each bag's end."""
    n = ids.shape[0]
    starts = offsets[:-1] if include_last else offsets  # (B,)
    counts = torch.cat([starts[1:], starts.new_tensor([n])]) - starts  # (B,)
    width = int(counts.max()) if n else 0
    steps = torch.arange(width, device=ids.device)
    inside = steps < counts[:, None]  # (B, L)
    at = torch.where(inside, starts[:, None] + steps, 0)  # (B, L) positions, 0 past the end
    w = torch.ones(n, device=ids.device) if weights is None else weights
    return torch.where(inside, ids[at], 0) if n else at, w[at] * inside if n else inside * 1.0


class Picked(Contribution):
    """G_i[v, d] = s_id where row v is the one ``rows[i, d]`` picks for column d, zero where
    ``rows`` is -1: an EmbeddingBag's max, which takes each column from one row of the bag."""

    def __init__(self, rows: Tensor, s: Tensor, num_rows: int):
        self.rows, self.s = rows.clamp_min(0), _acc(s) * (rows >= 0)  # (B, D) each
        self.shape = torch.Size((num_rows, s.shape[-1]))

    def examples(self, lo: int, hi: int) -> Contribution:
        return Picked(self.rows[lo:hi], self.s[lo:hi], self.shape[0])

    def norm_sq(self) -> Tensor:
        return self.s.pow(2).sum(1)  # each column lands on one row

    def inner(self, refs: Tensor) -> Tensor:
        cols = torch.arange(self.shape[1], device=self.s.device)
        picked = refs.to(self.s.dtype)[:, self.rows, cols]  # (K, B, D)
        return (picked * self.s).sum(2).T  # (B, K)

    def materialize(self) -> Tensor:
        b, d = self.s.shape
        grads = self.s.new_zeros(b, self.shape[0], d)
        return grads.scatter_add_(1, self.rows[:, None], self.s[:, None])  # (B, V, D)

    def batch_sum(self) -> Tensor:
        return self.s.new_zeros(self.shape).scatter_add_(0, self.rows, self.s)


@register_rule(nn.EmbeddingBag, name="embedding_bag", bags=_bags)
def embedding_bag(
    module: nn.EmbeddingBag,
    inputs: tuple[Tensor, ...],
    grad_output: Tensor,
    offsets: Tensor | None = None,
    per_sample_weights: Tensor | None = None,
) -> dict[str, Contribution]:
    """Bag i the example i's (a (B, L) input, or B bags cut by ``offsets``, which the engine
    checks): a bag adds its rows, weighted (or averaged), so G_i[v] = sum over its positions t
    with id v of w_t s_i; max takes each column d from one row, G_i[v, d] = s_id there."""
    ids = inputs[0]
    offsets = inputs[1] if len(inputs) > 1 else offsets  # positionally
    per_sample_weights = inputs[2] if len(inputs) > 2 else per_sample_weights
    if (ids.dim() == 1) != (offsets is not None) or ids.dim() > 2:
        raise NotImplementedError(f"input of {ids.dim()} dims with offsets {offsets is not None}")
    if module.mode == "max":
        return {"weight": _max(module, ids, offsets, grad_output)}
    if offsets is not None:
        ids, weights = _padded(ids, offsets, per_sample_weights, module.include_last_offset)
    else:
        weights = torch.ones_like(ids, dtype=grad_output.dtype)
        weights = weights if per_sample_weights is None else per_sample_weights
    weights = weights.to(grad_output.dtype)  # (B, L)
    if module.padding_idx is not None:
        weights = weights * (ids != module.padding_idx)  # padding is no member of the bag
    if module.mode == "mean":
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1)
    s = grad_output[:, None, :] * weights[..., None]  # (B, L, D)
    return {"weight": Rows(ids, s, module.num_embeddings)}


def _max(module: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None, grad_output: Tensor):
    """The row each column of each bag takes its maximum from, as the forward picks it (the
    first of equal values), none for a bag without a member."""
    flat = ids.reshape(-1)
    if offsets is None:
        offsets = torch.arange(0, flat.shape[0], max(ids.shape[1], 1), device=ids.device)
    weight = module.weight.detach()
    _, bag, size, rows = torch.embedding_bag(
        weight, flat, offsets, False, 2, False, None, module.include_last_offset,
        module.padding_idx,
    )  # fmt: skip
    rows = torch.where(size[:, None] > 0, rows, -1)  # (B, D)
    return Picked(rows, grad_output, module.num_embeddings)
