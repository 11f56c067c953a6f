"""Tensors computed from parameters alone (``engine/derived.py``), read where the batch is: each
parameter's per-example gradient against the float64 loop, and none on the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from computed_models import (
    D,
    Einsums,
    FunctionalConv,
    FusedExperts,
    HeadsFirst,
    Lookups,
    MaskedBias,
    ReadsAround,
    RelativeBias,
    RelativeWindow,
    Standardized,
    StateSpace,
    T,
    Tables,
    WeightNormed,
    Windows,
)
from oracle import Case, assert_fallback, assert_rel_close, reference_influence, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.engine.derived import Computed
from gradscope.losses import resolve_loss
from gradscope.rules import base


def _sequences(b: int) -> tuple[Tensor, ...]:
    return (torch.randn(b, T, 3),)


def _labels(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


CASES = [
    Case("state-space", StateSpace, _sequences, torch.randn_like),
    Case("state-space-batch-1", StateSpace, _sequences, torch.randn_like, batch=1),
    Case("weight-norm", WeightNormed, _sequences, _labels, "cross_entropy"),
    Case("functional-conv", FunctionalConv, _sequences, torch.randn_like),
    Case("standardized", Standardized, _sequences, torch.randn_like),
    Case("standardized-batch-1", Standardized, _sequences, torch.randn_like, batch=1),
    Case("functional-conv-batch-1", FunctionalConv, _sequences, torch.randn_like, batch=1),
    Case("windows", Windows, _sequences, torch.randn_like),
    Case("windows-batch-1", Windows, _sequences, torch.randn_like, batch=1),
    Case("reads-around", ReadsAround, _sequences, torch.randn_like),
    Case("reads-around-batch-1", ReadsAround, _sequences, torch.randn_like, batch=1),
    Case("fused-experts", FusedExperts, _sequences, torch.randn_like),
    Case("lookups", Lookups, lambda b: (torch.randint(0, 7, (b, T)),), torch.randn_like),
    Case(
        "lookups-batch-1",
        Lookups,
        lambda b: (torch.randint(0, 7, (b, T)),),
        torch.randn_like,
        batch=1,
    ),
    Case("relative-bias", RelativeBias, _sequences, torch.randn_like),
    Case("relative-bias-batch-1", RelativeBias, _sequences, torch.randn_like, batch=1),
    Case("einsums", Einsums, _sequences, torch.randn_like),
    Case("einsums-batch-1", Einsums, _sequences, torch.randn_like, batch=1),
    Case("tables", Tables, _sequences, torch.randn_like),
    Case("tables-batch-1", Tables, _sequences, torch.randn_like, batch=1),
    Case("heads-first", HeadsFirst, _sequences, torch.randn_like),
    Case("heads-first-batch-1", HeadsFirst, _sequences, torch.randn_like, batch=1),
    Case("masked-bias", MaskedBias, _sequences, torch.randn_like),
    Case("masked-bias-batch-1", MaskedBias, _sequences, torch.randn_like, batch=1),
    Case("relative-window", RelativeWindow, _sequences, torch.randn_like),
    Case("relative-window-batch-1", RelativeWindow, _sequences, torch.randn_like, batch=1),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_computed_from_parameters_match_loop(case: Case):
    model, inputs, targets = case.build(torch.float64)
    engine = Engine(model, resolve_loss(case.loss))
    for _ in range(2):  # the first batch checks itself; the second runs as decided
        with engine:
            scores = engine.norms(inputs, targets)
        for name, norm_sq in scores.norm_sq.items():
            _, expected = reference_norms(model, inputs, targets, case.loss, include=[name])
            assert_rel_close(norm_sq.sqrt(), expected, 1e-6)
    assert_fallback(engine)


class Unbatched(nn.Module):
    """A weight computed from a parameter, then read by an op the tap does not serve (a matmul
    of the batch by it from the left, ``torch.mm``): the parameter goes to the fallback."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(3, D))

    def forward(self, x: Tensor) -> Tensor:  # (B, 3)
        return torch.mm(x, torch.tanh(self.v))


def test_computed_read_by_an_op_not_served_goes_to_the_fallback():
    model, inputs, targets = Case(
        "mm", Unbatched, lambda b: (torch.randn(b, 3),), F.normalize
    ).build()
    engine = Engine(model, resolve_loss("mse"))
    with engine:
        scores = engine.norms(inputs, targets)
    _, expected = reference_norms(model, inputs, targets, "mse")
    assert_rel_close(scores.norm_sq["v"].sqrt(), expected, 1e-6)
    assert engine.plan.find("v").is_fallback and "mm" in engine.plan.find("v").note


@pytest.mark.parametrize("case", [c for c in CASES if "batch-1" not in c.id], ids=repr)
def test_computed_influence_matches_loop(case: Case):
    """Inner products with a reference gradient go through the same VJP as the norms."""
    model, inputs, targets = case.build(torch.float64, batch=7)
    train = (tuple(t[:4] for t in inputs), targets[:4])
    ref = (tuple(t[4:] for t in inputs), targets[4:])
    got = gradscope.per_example_influence(model, *train, *ref, case.loss, engine="hooks")
    expected, _, _ = reference_influence(model, *train, ref, case.loss)
    assert_rel_close(got, expected[:, 0], 1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if "batch-1" not in c.id], ids=repr)
def test_computed_through_fresh_api_calls(case: Case):
    """Two batches of one shape, a fresh ``per_example_norms`` call each: the second replays
    the first's decisions without a self-check."""
    model, _, _ = case.build(torch.float64)
    for seed in range(2):
        torch.manual_seed(seed + 1)
        inputs = tuple(t.to(torch.float64) if t.is_floating_point() else t for t in case.inputs(5))
        with torch.no_grad():
            targets = case.targets(model(*inputs))
        got = gradscope.per_example_norms(model, inputs, targets, case.loss)
        _, expected = reference_norms(model, inputs, targets, case.loss)
        assert_rel_close(got, expected, 1e-6)
    assert_fallback(model)


class MixedHeads(nn.Module):
    """A per-head ``W[:, None] @ x`` on states whose columns the trace sees mix the examples
    (a batch mean added, at weight 0: each example's loss is still its own): no example owns a
    product by the owners, so ``W`` goes to the fallback, still exact."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.x_proj = nn.Parameter(torch.randn(2, 4, D // 2))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x)
        h = h + 0 * h.mean(0, keepdim=True)
        states = h.view(x.shape[0], T, 2, D // 2).permute(2, 0, 3, 1)  # (heads, B, in, T)
        return (self.x_proj[:, None] @ states).sum((0, 2))


def test_products_of_mixed_columns_go_to_the_fallback():
    model, inputs, targets = Case("mixed-heads", MixedHeads, _sequences, torch.randn_like).build(
        torch.float64
    )
    engine = Engine(model, resolve_loss("mse"))
    with engine:
        scores = engine.norms(inputs, targets)
    _, expected = reference_norms(model, inputs, targets, "mse", include=["x_proj"])
    assert_rel_close(scores.norm_sq["x_proj"].sqrt(), expected, 1e-6)
    assert engine.plan.find("x_proj").is_fallback


# the cases that read a tensor computed from parameters (the fused experts read views only)
COMPUTED = [c for c in CASES if "batch-1" not in c.id and c.id != "fused-experts"]


@pytest.mark.parametrize("case", COMPUTED, ids=repr)
def test_computed_a_few_examples_at_a_time(case: Case, monkeypatch):
    """Where the batch's gradients of a computed tensor and of its sources would pass
    ``CHUNK_ELEMENTS``, they are formed a few examples at a time, again for each question:
    the same norms and inner products, on two batches."""
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 64)
    formed = []
    original = Computed._formed
    monkeypatch.setattr(
        Computed, "_formed", lambda self, part, k: formed.append(k) or original(self, part, k)
    )
    model, inputs, targets = case.build(torch.float64, batch=5)
    engine = Engine(model, resolve_loss(case.loss))
    for _ in range(2):
        with engine:
            scores = engine.norms(inputs, targets)
        _, expected = reference_norms(model, inputs, targets, case.loss)
        assert_rel_close(total(scores.norm_sq).sqrt(), expected, 1e-6)
    assert_fallback(engine)
    train, ref = (
        (tuple(t[:3] for t in inputs), targets[:3]),
        (tuple(t[3:] for t in inputs), targets[3:]),
    )
    got = gradscope.per_example_influence(model, *train, *ref, case.loss, engine="hooks")
    expected, _, _ = reference_influence(model, *train, ref, case.loss)
    assert_rel_close(got, expected[:, 0], 1e-6)
    assert formed, "no computed tensor was read"
