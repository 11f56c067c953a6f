"""Experts whose rows are picked by ANOTHER example's values: a boolean mask made from the ids
of other routes (``flat.roll(1) == e``: an example's first route is picked by the previous
example's last; ``flat.flip(0) == e``; a running sum of the ids over the whole batch), or the
positions where such a mask holds (``torch.where(mask)``, Mixtral's way, the rows taken by
key, or by ``index_select`` and put back by ``index_copy_``); and features
zeroed in place by another example's mask (``masked_fill_``). The examples are not
separable through an integer or boolean tensor, not through a gradient, so the batch's sum of
gradients cannot tell; the trace makes the picked rows MIXED (``analysis/selectors.py``), and
each batch is refused as mixing the examples, naming the pick, or exact against the float64
per-example loop (the examples checked alone agreeing: every parameter on the fallback). The
same experts routed by each row's own ids stay exact with no parameter on the fallback
(``tests/engine/replay/test_masked_experts.py``)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

H, E, K, F_IN, CLASSES = 6, 4, 2, 5, 3

# each route's expert id (flat: (N,)) -> the ids that pick each route's row
CROSSED = {
    "roll": lambda flat: flat.roll(1),
    "flip": lambda flat: flat.flip(0),
    "cumsum": lambda flat: flat.cumsum(0) % E,
}


class Experts(nn.Module):
    def __init__(self, crossed: str, by_index: str | None):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, H, 2 * H) / H**0.5)
        self.down = nn.Parameter(torch.randn(E, 2 * H, H) / H**0.5)
        self.crossed, self.by_index = CROSSED[crossed], by_index

    def forward(self, x: Tensor, index: Tensor, gates: Tensor) -> Tensor:
        rows = x.repeat_interleave(index.shape[1], dim=0)  # (N, H), N = rows * K
        flat = index.reshape(-1)  # (N,)
        out = torch.zeros_like(rows)
        for e in flat.unique():
            mask = self.crossed(flat) == e  # (N,): another route's id picks this row
            at = torch.where(mask)[0] if self.by_index else mask
            if self.by_index == "select":  # out.index_copy_ follows no index's owners
                y = torch.relu(rows.index_select(0, at) @ self.up[e]).square() @ self.down[e]
                out.index_copy_(0, at, y)
            else:
                out[at] = torch.relu(rows[at] @ self.up[e]).square() @ self.down[e]
        return (out.view(*index.shape, H) * gates.unsqueeze(-1)).sum(1)


class Model(nn.Module):
    def __init__(self, crossed: str, by_index: str | None):
        super().__init__()
        self.inp, self.gate = nn.Linear(F_IN, H), nn.Linear(H, E)
        self.experts, self.head = Experts(crossed, by_index), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, T, H)
        flat = h.reshape(-1, H)
        top, index = self.gate(flat).sigmoid().topk(K, dim=-1)
        out = h + self.experts(flat, index, top / top.sum(-1, keepdim=True)).view(h.shape)
        return self.head(out.mean(1))


@pytest.mark.parametrize("by_index", [None, "key", "select"], ids=["mask", "where", "select"])
@pytest.mark.parametrize("crossed", list(CROSSED))
def test_rows_picked_by_another_example_refused_or_exact(crossed: str, by_index: str | None):
    torch.manual_seed(2)
    model = Model(crossed, by_index).double().eval()
    refused = 0
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(3):  # the later batches replay what the first ones left, if any
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(3, 4, F_IN, generator=g, dtype=torch.float64)
            y = torch.randint(0, CLASSES, (3,), generator=g)
            expected = reference_norms(model, (x,), y, "cross_entropy")[1].square()
            try:
                got = total(engine.norms((x,), y).norm_sq)
            except ModelError as e:
                why = str(e)  # the pick, or the op that mixed the ids before it
                assert "mixes the examples" in why
                assert "picked by another example's values" in why or f"after {crossed}" in why
                refused += 1
                continue
            assert_rel_close(got, expected, 1e-9)
    assert refused  # the examples checked alone differ on some batch


class Filled(nn.Module):
    """Each token's features zeroed in place where the previous token's (the previous
    example's, for an example's first) largest feature is among the first two."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(F_IN, H), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, T, H)
        ids = h.argmax(-1).reshape(-1).roll(1).view(h.shape[:2])  # (B, T)
        h.masked_fill_((ids < 2).unsqueeze(-1), 0.0)
        return self.head(torch.tanh(h).mean(1))


def test_masked_fill_by_another_example_refused_or_exact():
    torch.manual_seed(3)
    model, refused = Filled().double().eval(), 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(3, 4, F_IN, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (3,), generator=g)
        expected = reference_norms(model, (x,), y, "cross_entropy")[1].square()
        with Engine(model, resolve_loss("cross_entropy")) as engine:
            try:
                got = total(engine.norms((x,), y).norm_sq)
            except ModelError as e:
                assert "masked_fill_, picked by another example's values" in str(e)
                refused += 1
                continue
        assert_rel_close(got, expected, 1e-9)
    assert refused
