"""A tensor made from constants stays one when another is written in place by the batch's values
(RWKV's CPU scan: its output, ``zeros_like``, written step by step, and its ``max_state``, a
``zeros_like`` less 1e38, read beside ``time_decay``): the scan's reads keep recipes, its region
is light, and the batches after the first of their shape replay with no trace, exact against the
float64 loop on batches of several shapes through one Engine and through fresh public calls.
Where the tensor written shares its storage with the one read (a view of it, or what it is a view
of), the read is of the batch's values, and the pass stays exact."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    assert_norms_through_one_engine,
    assert_rel_close,
    findings_by_shape,
    reference_norms,
)
from torch import Tensor, nn

import gradscope
from gradscope.engine.steps import RegionCall

D, CLASSES = 4, 3
SHAPES = [(3, 5), (1, 5), (3, 5), (2, 3), (1, 5), (2, 3), (3, 5)]  # (B, T), repeated


class Scan(nn.Module):
    """RWKV's scan: ``state`` made from a shape, read as ``state * decay`` after ``out`` (made
    from a shape too) was written by the batch's values; ``alias``: the batch's keys written
    into a view of ``state`` (``view``), or into ``state`` under a view read after (``base``)."""

    def __init__(self, alias: str):
        super().__init__()
        self.alias, self.key = alias, nn.Linear(D, D)
        self.decay = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        k = self.key(x)
        out = torch.zeros_like(k)
        state = torch.zeros_like(k[:, 0]) - 3.0  # (B, D), the same on every batch
        head = state[:, :2]
        if self.alias == "view":
            state.view(-1).copy_(k[:, 0].reshape(-1))
        elif self.alias == "base":
            state.copy_(k[:, 0])
        decay = -torch.exp(self.decay)
        for t in range(x.shape[1]):
            out[:, t] = torch.tanh(state + k[:, t])
            state = torch.maximum(state * decay, k[:, t])
        return out.sum(1)[:, :2] + head * decay[:2]


class Model(nn.Module):
    def __init__(self, alias: str):
        super().__init__()
        self.scan, self.head = Scan(alias), nn.Linear(2, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.scan(x))


def _batch(seed: int, n: int, t: int) -> tuple[tuple[Tensor, ...], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t, D, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (n,), generator=g)


@pytest.mark.parametrize("alias", ["none", "view", "base"])
def test_a_constant_written_elsewhere_replays_light_and_exact(alias: str):
    torch.manual_seed(0)
    model = Model(alias).double().eval()
    batches = [_batch(seed, n, t) for seed, (n, t) in enumerate(SHAPES)]
    engine = assert_norms_through_one_engine(model, batches, "cross_entropy")
    for findings in findings_by_shape(engine, _batch, SHAPES).values():
        regions = [s for s in findings.programs[-1].steps if isinstance(s, RegionCall)]
        if alias == "none":  # every read of the scan's by recipe: none traced
            assert regions and all(s.light is not None for s in regions)


def test_a_constant_written_elsewhere_through_fresh_calls():
    torch.manual_seed(0)
    model = Model("none").double().eval()
    for seed, (n, t) in enumerate(SHAPES[:4]):
        inputs, targets = _batch(seed, n, t)
        got = gradscope.per_example_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, reference_norms(model, inputs, targets, "cross_entropy")[1], 1e-9)


class _Vmapped(nn.Module):
    """A constant made and written inside the model's own ``vmap``: a batched tensor, whose
    storage torch does not give (unlimited_ocr's forward)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        def one(row: Tensor) -> Tensor:  # (T, D)
            buf = torch.zeros_like(row)
            buf.add_(row * self.scale)  # written by more than constants
            return buf.sum(0)

        return self.head(torch.func.vmap(one)(x))


def test_a_constant_written_inside_the_models_vmap_is_exact():
    torch.manual_seed(0)
    model = _Vmapped().double().eval()
    for seed, (n, t) in enumerate(SHAPES[:3]):
        inputs, targets = _batch(seed, n, t)
        got = gradscope.per_example_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, reference_norms(model, inputs, targets, "cross_entropy")[1], 1e-9)
