"""A model compiled with ``torch.compile``, whole or a module of it in place: scored eagerly,
op by op, as the hooks and the trace need (compiled, its forward failed inside dynamo), exact,
and compiled again once the Engine is left."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, model_state, reference_norms
from project import cli_norms
from torch import nn

import gradscope
from gradscope.engine import Engine
from gradscope.losses import resolve_loss

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
    before = model_state(eager)
    for k in range(2):  # two batches of one shape, other values: a fresh call each
        g = torch.Generator().manual_seed(k)
        x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (BATCH,), generator=g)
        norms = gradscope.per_example_norms(model, x, y, loss="cross_entropy")
        assert_rel_close(norms, reference_norms(eager, (x,), y, "cross_entropy")[1], 1e-9)
        before.assert_kept(eager)
    assert not compiled
    model(x)
    assert compiled


def test_engines_left_in_any_order_leave_nothing_compiled_eagerly():
    """A run's own Engine closes before those of its other checkpoints (``influence`` over
    TracIn's): compiled code compiles again once the last is left, whatever the order."""
    compiled: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        compiled.append(1)
        return graph.forward

    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(Block(), nn.Linear(D, CLASSES)).double(), backend=backend)
    loss = resolve_loss("cross_entropy")
    first, second = Engine(model, loss), Engine(nn.Linear(D, CLASSES).double(), loss)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    model(torch.randn(BATCH, D, dtype=torch.float64))
    assert not compiled  # an Engine is still entered
    second.__exit__(None, None, None)
    model(torch.randn(BATCH, D, dtype=torch.float64))
    assert compiled


def compiled_block() -> nn.Module:
    """A model factory that compiles what it returns, as a training script may."""
    torch.manual_seed(1)
    return torch.compile(nn.Sequential(Block(), nn.Linear(D, CLASSES)))


def test_a_compiled_model_from_a_factory_loads_a_plain_checkpoint_and_is_exact(tmp_path):
    """``gradscope norms`` on a factory returning a compiled model: the checkpoint, saved from
    the model itself, fits (no ``_orig_mod.`` asked for), the parameters keep their own names,
    and every batch is exact against the float64 loop."""
    torch.manual_seed(0)
    eager = nn.Sequential(Block(), nn.Linear(D, CLASSES)).double()
    batches = []
    for k in range(2):  # two batches of one shape, other values
        g = torch.Generator().manual_seed(k)
        x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
        batches.append(((x,), torch.randint(0, CLASSES, (BATCH,), generator=g)))
    scores = cli_norms(tmp_path, eager, "test_compiled:compiled_block", batches)
    for got, (inputs, targets) in zip(scores, batches, strict=True):
        expected = reference_norms(eager, inputs, targets, "cross_entropy")[1]
        assert_rel_close(got, expected, 1e-9)
