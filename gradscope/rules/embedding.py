"""nn.Embedding: rows hit by the same token in one example add up; cost free of vocabulary size."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import CHUNK_ELEMENTS, Contribution, _acc, register_rule
from .outer import Outer
from .projection import Projection

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
    parameter is the (num_rows, D) table, never formed per example unless asked.
    """

    def __init__(self, ids: Tensor, s: Tensor, num_rows: int):
        self.ids, self.s = ids, _acc(s)
        self.shape = torch.Size((num_rows, s.shape[-1]))

    def examples(self, lo: int, hi: int) -> Contribution:
        return Rows(self.ids[lo:hi], self.s[lo:hi], self.shape[0])

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
        return self.s.new_zeros(self.shape).index_add_(0, self.ids.flatten(), self.s.reshape(-1, d))

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
            return Rows(
                torch.cat([self.ids, other.ids], 1), torch.cat([self.s, other.s], 1), self.shape[0]
            )
        return super().merge(other)


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
    if by_freq:
        # the loop sees one example at a time, so a row is scaled by its count in that example
        group = _groups(example_keys(ids, num_rows))
        counts = torch.zeros_like(group).index_add_(0, group, torch.ones_like(group))
        s = s / counts[group].view(b, -1, 1).to(s.dtype)
    return Rows(ids, s, num_rows)


@register_rule(nn.EmbeddingBag, name="embedding_bag")
def embedding_bag(
    module: nn.EmbeddingBag,
    inputs: tuple[Tensor, ...],
    grad_output: Tensor,
    offsets: Tensor | None = None,
    per_sample_weights: Tensor | None = None,
) -> dict[str, Contribution]:
    """One bag per example, a (B, L) input: example i's bag adds its rows, weighted (or
    averaged), so G_i[v] = sum over its positions t with id v of w_t s_i."""
    ids = inputs[0]
    if len(inputs) > 1:  # offsets passed positionally
        offsets = inputs[1]
    if ids.dim() != 2 or offsets is not None or module.mode == "max":
        # bags from offsets are not the examples, and max picks rows by value
        raise NotImplementedError(f"mode {module.mode!r} with input of {ids.dim()} dims")
    weights = torch.ones_like(ids, dtype=grad_output.dtype)
    if per_sample_weights is not None:
        weights = per_sample_weights.to(grad_output.dtype)
    if module.padding_idx is not None:
        weights = weights * (ids != module.padding_idx)  # padding is no member of the bag
    if module.mode == "mean":
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1)
    s = grad_output[:, None, :] * weights[..., None]  # (B, L, D)
    return {"weight": Rows(ids, s, module.num_embeddings)}
