"""Outputs that are views of a tensor their call made, edited in place afterwards: each
parameter stays on its rule and its per-example gradient matches the float64 loop."""

from __future__ import annotations

import pytest
import torch
from oracle import Case, assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine
from gradscope.losses import resolve_loss

D, T = 4, 5


class EditedOutputs(nn.Module):
    """A Linear on (B, T, 3) (its output a view of its (B*T, D) product) with an embedding added
    in place, as RoCBert's embeddings do; an einsum of the batch with a parameter (a permuted
    view of its product) scaled in place through a slice, as Funnel's relative attention does
    after its shift."""

    def __init__(self):
        super().__init__()
        self.fc, self.emb = nn.Linear(3, D), nn.Embedding(7, D)
        self.kernel = nn.Parameter(torch.randn(D, D))
        self.head = nn.Linear(D, 2)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:  # (B, T, 3), (B, T)
        h = self.fc(x)
        h += self.emb(ids)
        att = torch.einsum("btd,de->bte", h, self.kernel)
        att[..., :2] *= 2.0
        return self.head(torch.tanh(att)).sum(1)


def _inputs(b: int) -> tuple[Tensor, Tensor]:
    return torch.randn(b, T, 3), torch.randint(0, 7, (b, T))


@pytest.mark.parametrize("batch", [1, 4])
def test_outputs_edited_through_views_stay_on_their_rules(batch: int):
    case = Case("edited", EditedOutputs, _inputs, torch.randn_like, batch=batch)
    model, inputs, targets = case.build(torch.float64)
    h = model.fc(inputs[0])
    assert h._base is not None and torch.einsum("btd,de->bte", h, model.kernel)._base is not None
    engine = Engine(model, resolve_loss("mse"))
    for _ in range(2):  # the first batch checks itself; the second runs as decided
        with engine:
            scores = engine.norms(inputs, targets)
        for name, norm_sq in scores.norm_sq.items():
            _, expected = reference_norms(model, inputs, targets, "mse", include=[name])
            assert_rel_close(norm_sq.sqrt(), expected, 1e-6)
    assert_fallback(engine)


def test_outputs_edited_through_views_through_fresh_api_calls():
    """Two batches of one shape, a fresh ``per_example_norms`` call each (the second replays
    the first's decisions without a self-check)."""
    model, _, _ = Case("edited", EditedOutputs, _inputs, torch.randn_like).build(torch.float64)
    for seed in range(2):
        torch.manual_seed(seed + 1)
        x, ids = _inputs(4)
        inputs = (x.double(), ids)
        targets = torch.randn(4, 2, dtype=torch.float64)
        got = gradscope.per_example_norms(model, inputs, targets, "mse")
        _, expected = reference_norms(model, inputs, targets, "mse")
        assert_rel_close(got, expected, 1e-6)
