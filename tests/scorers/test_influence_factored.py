"""Influence against references kept as their factors (``reference_gradients(factored=True)``):
the same scores as the references formed and as the float64 loop, on one position, sequences
with padding, a module called twice, tied weights, batch 1, and references of more positions
than R formed costs (formed, then)."""

from __future__ import annotations

import pytest
import torch
from oracle import Case, reference_influence
from test_influence import TiedLM, assert_cosine_close
from torch import Tensor, nn

import gradscope
from gradscope.api import batch
from gradscope.engine import Engine, Influence, influence, reference_gradients
from gradscope.engine.backward import serve
from gradscope.losses import resolve_loss
from gradscope.rules import Outer, Rows, factored
from gradscope.rules.factored import Factored


@pytest.fixture(autouse=True)
def no_floor(monkeypatch):
    """The factors' route wherever it saves work, however little (``factored.DISPATCH``), so
    that these small batches take it."""
    monkeypatch.setattr(factored, "DISPATCH", 0)


W = 32  # wide enough that a few positions' factors cost less than R formed (W * W)


class Masked(nn.Module):
    """Linears over positions, the padded ones' outputs masked: their output gradients zero."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(12, W), nn.Linear(W, W), nn.Linear(W, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))) * mask[..., None]


class Tied(nn.Module):
    """A Linear called twice and two Linears of one weight: their positions merge."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.twice, self.b, self.c = (nn.Linear(12, W), nn.Linear(W, W),
                                              nn.Linear(W, W), nn.Linear(W, W))  # fmt: skip
        self.c.weight = self.b.weight
        self.head = nn.Linear(W, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.twice(torch.tanh(self.twice(torch.tanh(self.a(x))))))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h)))))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 2))


def _padded(b: int) -> tuple[Tensor, Tensor]:
    mask = torch.ones(b, 4)
    mask[::2, 2:] = 0  # every other example: its last two positions padding
    return torch.randn(b, 4, 12), mask


def _labels(classes: int):
    return lambda out: torch.randint(0, classes, out.shape[:-1])


CASES = [
    Case("one-position", _mlp, lambda b: (torch.randn(b, 12),), _labels(2), "cross_entropy"),
    Case("batch-1", _mlp, lambda b: (torch.randn(b, 12),), _labels(2), "cross_entropy", batch=1),
    Case("padded-seq", Masked, _padded, lambda out: torch.randn_like(out)),
    Case("twice-and-tied", Tied, lambda b: (torch.randn(b, 12),), _labels(3), "cross_entropy"),
    Case("tied-lm", TiedLM, lambda b: (torch.randint(0, 11, (b, 5)),), _labels(11), "cross_entropy"),
]  # fmt: skip
# the weights whose references the factors hold, per case (the rest formed: a bias, a tied table
# and head); per reference, a one-position head of few outputs too (K * (O + I + 1) < K * O * I)
FACTORED = {
    "one-position": {"0.weight", "2.weight"},
    "batch-1": {"0.weight", "2.weight"},
    "padded-seq": {"a.weight", "b.weight"},
    "twice-and-tied": {"a.weight", "twice.weight", "b.weight"},
    "tied-lm": set(),
}
PER_REF = {"one-position": {"4.weight"}, "batch-1": {"4.weight"}, "twice-and-tied": {"head.weight"}}


def _problem(case: Case, n: int):
    model, inputs, targets = case.build()
    _, ref_inputs, ref_targets = case.build(batch=n, seed=1)
    return model, inputs, targets, (ref_inputs, ref_targets)


@pytest.mark.parametrize("norms", [False, True], ids=["inner", "with norms"])
@pytest.mark.parametrize("per_ref", [False, True], ids=["mean", "per-ref"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_factored_references_score_as_formed_and_loop(case: Case, per_ref: bool, norms: bool):
    model, inputs, targets, refs = _problem(case, n=3)
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, refs, case.loss, per_ref=per_ref
    )
    core = Engine(model, resolve_loss(case.loss))
    with core:
        kept = reference_gradients(core, [refs], per_ref=per_ref, factored=True)
        formed = reference_gradients(core, [refs], per_ref=per_ref)
        scores = [Influence(core, r, "hooks", norms=norms) for r in (kept, formed)]
        first, second = ([s(inputs, targets) for s in scores] for _ in range(2))  # replayed too
    held = FACTORED[case.id] | (PER_REF.get(case.id, set()) if per_ref else set())
    assert {n for n, r in kept.items() if isinstance(r, Factored)} == held
    assert all(r._dense is None for r in kept.values() if isinstance(r, Factored))
    for through, formed_ in (first, second):
        assert_cosine_close(through.inner, expected, g_norm, r_norm)
        torch.testing.assert_close(through.inner, formed_.inner, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(scores[0].ref_norm, r_norm, rtol=1e-10, atol=0)


def test_references_of_more_positions_than_r_costs_are_formed():
    """A mean over 40 rows (40 * (W + W + 1) > W * W) is formed; so is one whose factors grow
    past it batch by batch (10 rows each: held after the first, formed from the second on)."""
    case = CASES[0]
    model, inputs, targets, (ref_inputs, ref_targets) = _problem(case, n=40)
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, (ref_inputs, ref_targets), case.loss
    )
    whole = [(ref_inputs, ref_targets)]
    parts = [((ref_inputs[0][lo : lo + 10],), ref_targets[lo : lo + 10]) for lo in range(0, 40, 10)]
    core = Engine(model, resolve_loss(case.loss))
    with core:
        for batches in (whole, parts):
            refs = reference_gradients(core, batches, factored=True)
            assert not any(isinstance(r, Factored) for r in refs.values())
            scores = Influence(core, refs, "hooks", norms=False)(inputs, targets)
            assert_cosine_close(scores.inner, expected, g_norm, r_norm)


def test_the_forward_mode_engine_takes_them_formed():
    case = CASES[0]
    model, inputs, targets, refs = _problem(case, n=3)
    expected, g_norm, r_norm = reference_influence(model, inputs, targets, refs, case.loss)
    core = Engine(model, resolve_loss(case.loss))
    with core:
        scorer = Influence(core, reference_gradients(core, [refs], factored=True), "jvp", False)
        scores = scorer(inputs, targets)
    assert scorer.method == "jvp"
    assert_cosine_close(scores.inner, expected, g_norm, r_norm)


def test_the_api_hooks_score_factored(monkeypatch):
    """``per_example_influence(engine="hooks")``: the references factored, the loop's scores."""
    asked = []
    real = influence.reference_gradients

    def recorded(*args, **kwargs):
        refs = real(*args, **kwargs)
        asked.append({n for n, r in refs.items() if isinstance(r, Factored)})
        return refs

    monkeypatch.setattr(batch, "reference_gradients", recorded)
    case = CASES[0]
    model, inputs, targets, refs = _problem(case, n=3)
    expected, g_norm, r_norm = reference_influence(model, inputs, targets, refs, case.loss)
    actual = gradscope.per_example_influence(
        model, inputs, targets, *refs, loss=case.loss, engine="hooks"
    )
    assert asked == [FACTORED[case.id]]
    assert_cosine_close(actual, expected[:, 0], g_norm, r_norm)


@pytest.mark.parametrize("per_ref", [False, True], ids=["mean", "per-ref"])
def test_a_tied_table_and_head_are_kept_apart(monkeypatch, per_ref: bool):
    """The contributions a reference pass keeps of a tied table and head (``Kinds``): the mean
    sums each kind's batch sum, no example's gradient formed, the first (self-checked) batch
    too; per reference each is formed, and the scores are the loop's."""
    case = CASES[-1]
    model, inputs, targets, refs = _problem(case, n=3)
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, refs, case.loss, per_ref=per_ref
    )
    formed = []
    for kind in (Rows, Outer):
        real = kind.materialize
        monkeypatch.setattr(kind, "materialize", lambda c, real=real: formed.append(c) or real(c))
    core = Engine(model, resolve_loss(case.loss))
    with core:
        directions = reference_gradients(core, [refs], per_ref=per_ref, factored=True)
        assert bool(formed) == per_ref
        scores = Influence(core, directions, "hooks", norms=True)(inputs, targets)
    assert_cosine_close(scores.inner, expected, g_norm, r_norm)


class Cls(nn.Module):
    """Alike Linears over 8 positions, mixed between layers, the head reading the first position
    alone (a BERT classifier's [CLS]): the last layer's reference is reached through one position
    an example, the others' through all eight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(3))
        self.head = nn.Linear(W, 2)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
            x = x + x.mean(1, keepdim=True)  # positions mixed, as attention mixes them
        return self.head(torch.tanh(self.layers[-1](x))[:, 0])


def test_alike_calls_whose_factors_do_not_pay_score_as_the_loop(monkeypatch):
    """Alike calls answered together (``Grouped``, however small), the last one's reference
    factored: where its factors do not pay on a small batch (``DISPATCH``), it is formed and
    stacked with the others' (one product for the group), the scores the float64 loop's and those of the references formed,
    on two batches of one shape, the model's parameters as they were."""
    monkeypatch.setattr(factored, "DISPATCH", 1 << 20)
    monkeypatch.setattr(serve, "held_budget", lambda calls: 1 << 40)  # every alike call held
    mixed, alone = [], []
    inners, inner = factored.inners, factored.inner

    def spy_inners(part, refs, batch):
        mixed.append({type(r) for r in refs})
        return inners(part, refs, batch)

    def spy_inner(c, ref, norms=False):
        alone.append(isinstance(ref, Factored))
        return inner(c, ref, norms)

    monkeypatch.setattr(factored, "inners", spy_inners)
    monkeypatch.setattr(factored, "inner", spy_inner)
    case = Case("cls", Cls, lambda b: (torch.randn(b, 8, W),), _labels(2), "cross_entropy")
    model, _, _ = case.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, ref_inputs, ref_targets = case.build(batch=3, seed=1)
    core = Engine(model, resolve_loss(case.loss))
    with core:
        kept = reference_gradients(core, [(ref_inputs, ref_targets)], factored=True)
        formed = reference_gradients(core, [(ref_inputs, ref_targets)])
        scorers = [Influence(core, r, "hooks", norms=False) for r in (kept, formed)]
        for seed in (2, 3):  # two batches of one shape, different values
            _, inputs, targets = case.build(seed=seed)
            expected, g_norm, r_norm = reference_influence(
                model, inputs, targets, (ref_inputs, ref_targets), case.loss
            )
            through, as_formed = (s(inputs, targets) for s in scorers)
            assert_cosine_close(through.inner, expected, g_norm, r_norm)
            torch.testing.assert_close(through.inner, as_formed.inner, rtol=1e-10, atol=1e-12)
    assert {n for n, r in kept.items() if isinstance(r, Factored)} == {"layers.2.weight"}
    assert {Factored, torch.Tensor} in mixed and not any(alone)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
