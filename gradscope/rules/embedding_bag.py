"""nn.EmbeddingBag: rows hit by the same token in one bag add up, each position weighted
(``embedding.Rows``); its max, each column from one row."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from .base import Contribution, _acc
from .embedding import Rows, by_count
from .registry import register_rule

# ``F.embedding_bag``'s arguments, in order: the trace and the replay bind its calls by them
BAG_ARGS = ("input", "weight", "offsets", "max_norm", "norm_type", "scale_grad_by_freq", "mode")
BAG_ARGS += ("sparse", "per_sample_weights", "include_last_offset", "padding_idx")


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
) -> tuple[Tensor, Tensor, Tensor]:
    """(B, L) ids, weights and members of (N,) ids cut into B bags by ``offsets``, L the
    longest bag's length (read on the host), weight 0 and no member past each bag's end."""
    n = ids.shape[0]
    starts = offsets[:-1] if include_last else offsets  # (B,)
    counts = torch.cat([starts[1:], starts.new_tensor([n])]) - starts  # (B,)
    width = int(counts.max()) if n else 0
    steps = torch.arange(width, device=ids.device)
    inside = steps < counts[:, None]  # (B, L)
    at = torch.where(inside, starts[:, None] + steps, 0)  # (B, L) positions, 0 past the end
    w = torch.ones(n, device=ids.device) if weights is None else weights
    if not n:
        return at, inside * 1.0, inside
    return torch.where(inside, ids[at], 0), w[at] * inside, inside


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
    with id v of w_t s_i, divided by v's count in the bag with ``scale_grad_by_freq``
    (``by_count``); max takes each column d from one row, G_i[v, d] = s_id there."""
    ids = inputs[0]
    offsets = inputs[1] if len(inputs) > 1 else offsets  # positionally
    per_sample_weights = inputs[2] if len(inputs) > 2 else per_sample_weights
    if (ids.dim() == 1) != (offsets is not None) or ids.dim() > 2:
        raise NotImplementedError(f"input of {ids.dim()} dims with offsets {offsets is not None}")
    if module.mode == "max":
        return {"weight": _max(module, ids, offsets, grad_output)}
    if module.scale_grad_by_freq and not counts_own_rows(grad_output.device):
        raise NotImplementedError(  # the plan's note keeps the first 39 characters
            f"pytorch#190063: {grad_output.device.type} embedding_bag divides rows by other "
            f"rows' counts (scale_grad_by_freq, torch {torch.__version__})"
        )
    member = None
    if offsets is not None:
        ids, weights, member = _padded(ids, offsets, per_sample_weights, module.include_last_offset)
    else:
        weights = torch.ones_like(ids, dtype=grad_output.dtype)
        weights = weights if per_sample_weights is None else per_sample_weights
    weights = weights.to(grad_output.dtype)  # (B, L)
    if module.padding_idx is not None:
        weights = weights * (ids != module.padding_idx)  # padding is no member of the bag
    if module.mode == "mean":
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1)
    s = grad_output[:, None, :] * weights[..., None]  # (B, L, D)
    if module.scale_grad_by_freq:
        return {"weight": by_count(ids, s, module.num_embeddings, member)}
    return {"weight": Rows(ids, s, module.num_embeddings)}


@functools.cache
def counts_own_rows(device: torch.device) -> bool:
    """Whether torch's embedding_bag backward on ``device`` divides each row by its own count
    (``scale_grad_by_freq``): torch 2.13's CPU one divides a row by the count of the row at
    its place in the sorted ids (``[1, 1, 3]``: row 3 by 2), which the loop then sees and the
    rule would not; the fallback serves there, and where the probe cannot run."""
    w, on = torch.zeros(4, 1, dtype=torch.float64, device=device), {"device": device}
    ids, offsets = torch.tensor([1, 1, 3], **on), torch.zeros(1, dtype=torch.long, **on)
    try:  # float64: float32's forward on the CPU leaves offset2bag empty without a grad
        _, bag, size, top = torch._embedding_bag(w, ids, offsets, False, 0, False, None)
        g = torch.ops.aten._embedding_bag_dense_backward(
            torch.ones(1, 1, dtype=w.dtype, **on), ids, bag, size, top, 4, True, 0, None
        )  # (4, 1)
    except RuntimeError:
        return False
    return bool(g[3, 0] == 1)


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
