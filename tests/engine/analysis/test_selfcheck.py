"""The self-check of an analysed batch in float32: a rule with one term off by 0.999 (within
float32's old tolerance, 1e-3 of the norm) goes to the fallback, whose numbers are the loop's;
the same models with their rules as written keep every parameter on its rule. And a table that
scales its rows' gradients by their counts (``scale_grad_by_freq``), whose examples' gradients
do not add up to autograd's batch gradient, is served by its rule, exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_models import Block, Experts
from oracle import (
    Case,
    assert_case_matches_loop,
    assert_fallback,
    assert_rel_close,
    reference_norms,
)
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads, total
from gradscope.engine.analysis.experts import ExpertReads
from gradscope.losses import resolve_loss
from gradscope.rules.registry import RULES

B, CLASSES, OFF = 4, 3, 0.999


class Routed(nn.Module):
    """A Linear, then a router's top 2 of 4 experts run by ``grouped_mm``, then a head."""

    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(8, 8), Block(Experts()), nn.Linear(8, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


def _off(kind: type[nn.Module], attr: str, monkeypatch) -> None:
    """``kind``'s rule with its ``attr`` term scaled by 0.999, the others as written."""
    rule = RULES[kind]

    def scaled(module, inputs, grad_output, **kwargs):
        off = rule.fn(module, inputs, grad_output * OFF, **kwargs)
        return {**rule.fn(module, inputs, grad_output, **kwargs), attr: off[attr]}

    monkeypatch.setitem(RULES, kind, dataclasses.replace(rule, fn=scaled))


def _experts_off(monkeypatch) -> None:
    """The routed experts' read (``grouped_mm``'s rows per expert) scaled by 0.999."""
    experts = ExpertReads._experts

    def scaled(self, d, weight, a, grad, *rest):
        return experts(self, d, weight, a, grad * OFF, *rest)

    monkeypatch.setattr(ExpertReads, "_experts", scaled)


# name: (model, input shape, the parameters put off, how)
CASES = {
    "linear": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, CLASSES)),
        (B, 6),
        ["0.weight", "2.weight"],
        lambda mp: _off(nn.Linear, "weight", mp),
    ),
    "layernorm": (
        lambda: nn.Sequential(
            nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 8, CLASSES)
        ),
        (B, 5, 6),
        ["1.weight"],
        lambda mp: _off(nn.LayerNorm, "weight", mp),
    ),
    "conv": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, CLASSES)
        ),
        (B, 2, 6, 6),
        ["0.weight"],
        lambda mp: _off(nn.Conv2d, "weight", mp),
    ),
    "routed": (Routed, (B, 5, 8), ["block.experts.gate_up", "block.experts.down"], _experts_off),
}


def _scored(name: str) -> Engine:
    """The case's float32 batch through an Engine, its norms against the loop's: the float64
    loop's, but for the experts', which ``grouped_mm`` runs in float32 alone."""
    build, shape, _, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(shape), torch.randint(0, CLASSES, (B,))
    loss = resolve_loss("cross_entropy")
    with Engine(model, loss) as engine:
        norms = total(engine.norms((x,), y).norm_sq)
        names = [p.name for p in engine.plan.included]
    if name == "routed":
        grads = naive_grads(model, (x,), y, loss, names, Forward())[1].values()
        expected = sum(g.flatten(1).double().square().sum(1) for g in grads)
    else:
        expected = reference_norms(model, (x,), y, "cross_entropy")[1].square()
    assert_rel_close(norms, expected, 1e-4)  # exact where a rule is off: on the fallback
    return engine


@pytest.mark.parametrize("name", CASES)
def test_a_rule_off_by_0_999_goes_to_the_fallback_in_float32(name: str, monkeypatch) -> None:
    CASES[name][3](monkeypatch)
    engine = _scored(name)
    assert_fallback(engine, CASES[name][2])


@pytest.mark.parametrize("name", CASES)
def test_the_rules_as_written_pass_it_in_float32(name: str) -> None:
    engine = _scored(name)
    assert_fallback(engine)


FREQ = Case(
    "embedding-scale-grad-by-freq-head",
    lambda: nn.Sequential(
        nn.Embedding(8, 3, scale_grad_by_freq=True, padding_idx=1), nn.Tanh(), nn.Linear(3, 2)
    ),
    lambda b: (torch.randint(0, 5, (b, 10)),),  # few rows: each counted several times
    torch.randn_like,
)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_table_scaled_by_frequency_is_served_by_its_rule(dtype, tmp_path) -> None:
    """Its examples' gradients each divide a row by its count in the example, autograd's batch
    gradient by its count in the batch: the check weighs the examples' rows by the two counts'
    ratio. The API and ``gradscope norms`` against the loop, nothing on the fallback."""
    assert_case_matches_loop(FREQ, dtype, 1e-5 if dtype == torch.float64 else 1e-4, tmp_path)


def test_a_training_step_of_a_table_scaled_by_frequency_is_autograds() -> None:
    """The table on its rule through two steps of a signature (the first self-checked, the
    second replayed): each batch gradient autograd's, a row divided by its count in the batch."""
    torch.manual_seed(0)
    model, x, y = FREQ.build(torch.float64)
    params = list(model.parameters())
    loss = resolve_loss(FREQ.loss)
    with Engine(model, loss) as engine:
        steps = [engine.step(x, y, params) for _ in range(2)]
    expected = torch.autograd.grad(loss(model(*x), y).sum(), params)
    for scores in steps:
        for g, e in zip(scores.trained, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    assert_fallback(engine)
