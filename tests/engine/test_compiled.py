"""A model compiled with ``torch.compile``, whole or a module of it in place: scored eagerly,
op by op, as the hooks and the trace need (compiled, its forward failed inside dynamo), exact,
and compiled again once the Engine is left."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, reference_norms
from torch import nn

import gradscope

D, CLASSES, BATCH = 6, 3, 5


class Block(nn.Module):
    """A module of the user's: dynamo compiles its forward (it leaves torch's own layers be)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("how", ["whole", "in place"])
def test_a_compiled_model_is_scored_eagerly_and_compiled_after(how: str):
    compiled: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        compiled.append(1)
        return graph.forward

    torch.manual_seed(0)
    eager = nn.Sequential(Block(), nn.Linear(D, CLASSES), nn.LayerNorm(CLASSES)).double()
    if how == "whole":
        model = torch.compile(eager, backend=backend)
    else:
        model = eager
        model[0].compile(backend=backend)
    x = torch.randn(BATCH, D, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,))
    for _ in range(2):
        norms = gradscope.per_example_norms(model, x, y, loss="cross_entropy")
        assert_rel_close(norms, reference_norms(eager, (x,), y, "cross_entropy")[1], 1e-9)
    assert not compiled
    model(x)
    assert compiled
