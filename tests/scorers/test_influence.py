"""Influence, both engines, against a float64 loop that forms every gradient explicitly."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import Case, reference_influence
from torch import Tensor, nn

import gradscope
from gradscope.curvature.adam import adam_denominator
from gradscope.engine import Engine, Influence, influence_errors, reference_gradients
from gradscope.engine.backward import batched, serve
from gradscope.engine.backward.reduce import Reducer
from gradscope.errors import GradscopeError
from gradscope.losses import resolve_loss
from gradscope.rules.factored import dense

TOL = 1e-6  # |delta influence| / (||g_i|| ||g_ref||), in float64


class Twice(nn.Module):
    """One Linear called at two places: its contributions must add up before any inner product."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(torch.tanh(self.inner(x))))


class ReluFn(torch.autograd.Function):
    """A custom op with a backward but no forward-mode rule: jvp must fall back to hooks."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x > 0)


class NoForwardMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(ReluFn.apply(self.a(x)))


class Attention(nn.Module):
    """nn.MultiheadAttention between Linears: its fused inference kernel lacks forward mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.att, self.out = (
            nn.Linear(4, 8),
            nn.MultiheadAttention(8, 2, batch_first=True),
            nn.Linear(8, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.out(h + self.att(h, h, h, need_weights=False)[0])


class ConvNet(nn.Module):
    """Grouped Conv2d, BatchNorm (eval), GroupNorm and Conv1d before a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.bn, self.gn = nn.BatchNorm2d(4), nn.GroupNorm(2, 4)
        self.conv1d, self.fc = nn.Conv1d(4, 3, 2), nn.Linear(3 * 15, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.gn(torch.relu(self.bn(self.conv(x))))  # (B, 4, 4, 4)
        return self.fc(self.conv1d(h.flatten(2)).flatten(1))  # (B, 3, 15) -> (B, 3)


class TiedLM(nn.Module):
    """Embedding, LayerNorm and an output layer tied to the embedding: contributions add up."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 11)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.norm(self.emb(ids)))


def _labels(classes: int):
    return lambda out: torch.randint(0, classes, out.shape[:-1])


CASES = [
    Case(
        "mlp-2d-ce",
        lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
        lambda b: (torch.randn(b, 6),),
        _labels(3),
        loss="cross_entropy",
    ),
    Case(
        "mlp-seq-mse",  # T=3 positions; one layer widens (o > i), one narrows (o <= i)
        lambda: nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2)),
        lambda b: (torch.randn(b, 3, 4),),
        lambda out: torch.randn_like(out),
    ),
    Case(
        "mlp-seq-ce-tokens",
        lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 7)),
        lambda b: (torch.randn(b, 3, 4),),
        _labels(7),
        loss="cross_entropy",
    ),
    Case("shared-linear", Twice, lambda b: (torch.randn(b, 4),), _labels(2), loss="cross_entropy"),
    Case("conv-norms", ConvNet, lambda b: (torch.randn(b, 2, 4, 4),), _labels(3), "cross_entropy"),
    Case("tied-lm", TiedLM, lambda b: (torch.randint(0, 11, (b, 5)),), _labels(11), "cross_entropy"),
    Case("batch-1", lambda: nn.Linear(3, 2), lambda b: (torch.randn(b, 3),), _labels(2), "cross_entropy", batch=1),
]  # fmt: skip


def assert_cosine_close(actual: Tensor, expected: Tensor, g_norm: Tensor, r_norm: Tensor) -> None:
    err = (actual.double() - expected).abs() / (g_norm[:, None] * r_norm[None]).reshape(
        expected.shape
    )
    assert err.max().item() < TOL, f"error {err.max().item():.3g} in cosine units"


def _refs(case: Case, n: int = 4):
    model, inputs, targets = case.build()
    _, ref_inputs, ref_targets = case.build(batch=n, seed=1)
    return model, inputs, targets, (ref_inputs, ref_targets)


@pytest.mark.parametrize("engine", ["hooks", "jvp"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_mean_reference_matches_loop(case: Case, engine: str) -> None:
    model, inputs, targets, refs = _refs(case)
    expected, g_norm, r_norm = reference_influence(model, inputs, targets, refs, case.loss)
    # twice: forward mode scores a signature the hooks' pass has analysed (``proven``)
    for _ in range(2):
        actual = gradscope.per_example_influence(
            model, inputs, targets, *refs, loss=case.loss, engine=engine
        )
        assert actual.shape == (targets.shape[0],)
        assert_cosine_close(actual, expected[:, 0], g_norm, r_norm)


@pytest.mark.parametrize("engine", ["hooks", "jvp"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_per_ref_and_norms_match_loop(case: Case, engine: str) -> None:
    model, inputs, targets, refs = _refs(case, n=3)
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, refs, case.loss, per_ref=True
    )
    core = Engine(model, resolve_loss(case.loss))
    with core:
        scorer = Influence(
            core, reference_gradients(core, [refs], per_ref=True), engine, norms=True
        )
        scorer(inputs, targets)  # the signature analysed: forward mode may score the next
        scores = scorer(inputs, targets)
    assert scorer.method == engine
    assert scores.inner.shape == (targets.shape[0], 3)
    assert_cosine_close(scores.inner, expected, g_norm, r_norm)
    torch.testing.assert_close(scores.norm_sq.sqrt(), g_norm, rtol=1e-10, atol=0)
    torch.testing.assert_close(scorer.ref_norm, r_norm, rtol=1e-10, atol=0)


ALIKE = Case(  # layers alike (``Plan.alike``): calls answered together, the inner products held
    "alike-mlp",
    lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)),
    lambda b: (torch.randn(b, 3, 4),),
    _labels(2),
    loss="cross_entropy",
)


@pytest.mark.parametrize("held", [batched.HELD_DENSE, 0], ids=["held", "at once"])
@pytest.mark.parametrize("per_ref", [False, True], ids=["mean", "per-ref"])
@pytest.mark.parametrize("case", [*CASES, ALIKE], ids=repr)
def test_later_batches_inner_products_alone_match_loop(
    monkeypatch, case: Case, per_ref: bool, held: int
) -> None:
    """Hooks influence without norms over three batches of one scorer: after the first (whose
    self-check asks for norms too) each pass asks the inner products alone (the reducer's
    ``_inners_only``), each part held back to answer with its like or answered at once."""
    monkeypatch.setattr(batched, "HELD_DENSE", held)
    alone = []  # each pass's reducer: whether it asked the inner products alone

    class Recorded(Reducer):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            alone.append(self._inners_only)

    monkeypatch.setattr(serve, "Reducer", Recorded)
    model, _, _, refs = _refs(case, n=3)
    batches = [case.build(seed=seed)[1:] for seed in (2, 3, 4)]
    core = Engine(model, resolve_loss(case.loss))
    with core:
        directions = reference_gradients(core, [refs], per_ref=per_ref)
        scorer = Influence(core, directions, "hooks", norms=False)
        scored = [scorer(inputs, targets) for inputs, targets in batches]
    assert alone[-2:] == [True, True]
    for (inputs, targets), scores in zip(batches, scored, strict=True):
        expected, g_norm, r_norm = reference_influence(
            model, inputs, targets, refs, case.loss, per_ref=per_ref
        )
        assert scores.inner.shape == expected.shape and scores.norm_sq is None
        assert_cosine_close(scores.inner, expected, g_norm, r_norm)


def test_reference_mean_does_not_depend_on_batching() -> None:
    model, _, _, (ref_inputs, ref_targets) = _refs(CASES[0], n=7)
    core = Engine(model, resolve_loss("cross_entropy"))
    with core:
        whole = reference_gradients(core, [(ref_inputs, ref_targets)])
        parts = reference_gradients(
            core, [((ref_inputs[0][:3],), ref_targets[:3]), ((ref_inputs[0][3:],), ref_targets[3:])]
        )
    for name in whole:
        torch.testing.assert_close(parts[name], whole[name], rtol=1e-12, atol=1e-15)


def test_excluded_parameters_are_left_out() -> None:
    model, inputs, targets, refs = _refs(CASES[0])
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, refs, "cross_entropy", exclude=("0.*",)
    )
    actual = gradscope.per_example_influence(model, inputs, targets, *refs, exclude=["0.*"])
    assert_cosine_close(actual, expected[:, 0], g_norm, r_norm)


def _adam_state(model: nn.Module, steps: int = 3, **kwargs) -> dict:
    """A real optimizer's state after a few steps on a copy of ``model``."""
    trained = copy.deepcopy(model)
    opt = torch.optim.Adam(trained.parameters(), lr=1e-2, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        trained(torch.randn(8, 6, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
    return opt.state_dict()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("engine", ["hooks", "jvp"])
def test_precondition_matches_loop(engine: str, amsgrad: bool) -> None:
    model, inputs, targets, refs = _refs(CASES[0])
    state = _adam_state(model, betas=(0.8, 0.95), eps=1e-3, amsgrad=amsgrad)
    moment = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
    denominators = {}
    for (name, _), s in zip(model.named_parameters(), state["state"].values(), strict=True):
        # the denominator of Adam's step: sqrt(v / (1 - beta2^t)) + eps
        denominators[name] = (s[moment] / (1 - 0.95 ** s["step"].item())).sqrt() + 1e-3
    expected, g_norm, r_norm = reference_influence(
        model, inputs, targets, refs, "cross_entropy", denominators=denominators
    )
    actual = gradscope.per_example_influence(
        model, inputs, targets, *refs, precondition=state, engine=engine
    )
    assert_cosine_close(actual, expected[:, 0], g_norm, r_norm)


def test_precondition_mismatch_is_named() -> None:
    model = CASES[0].build()[0]
    core = Engine(model, resolve_loss("cross_entropy"))
    other = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 3)).double()
    with pytest.raises(GradscopeError, match="optimizer state has 6 parameters, the model has 4"):
        adam_denominator(torch.optim.Adam(other.parameters()).state_dict(), core, "adam.pt")
    wrong = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    state = torch.optim.Adam(wrong.parameters()).state_dict()
    state["state"] = {i: {"step": torch.tensor(1.0), "exp_avg_sq": torch.ones_like(p)}
                      for i, p in enumerate(wrong.parameters())}  # fmt: skip
    with pytest.raises(GradscopeError, match=r"0.weight has shape \(4, 6\).*\(5, 6\)"):
        adam_denominator(state, core, "adam.pt")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(GradscopeError, match="no Adam second moment"):
        adam_denominator(sgd, core, "sgd.pt")


def _jvp_scorer(case: Case) -> Influence:
    """The jvp scorer run once on ``case``, its inner products checked against the loop."""
    model, inputs, targets, refs = _refs(case)
    expected, g_norm, r_norm = reference_influence(model, inputs, targets, refs, case.loss)
    core = Engine(model, resolve_loss(case.loss))
    with core:
        scorer = Influence(core, reference_gradients(core, [refs]), "jvp", norms=False)
        first = scorer(inputs, targets)  # the hooks' pass: the signature's analysis
        assert not scorer.forward_mode
        scores = scorer(inputs, targets)
    for s in (first, scores):
        assert_cosine_close(s.inner, expected, g_norm, r_norm)
    return scorer


def test_jvp_falls_back_to_hooks_when_an_op_lacks_forward_mode() -> None:
    case = Case(
        "no-fwd", NoForwardMode, lambda b: (torch.randn(b, 3),), _labels(3), "cross_entropy"
    )
    scorer = _jvp_scorer(case)
    assert scorer.method == "hooks" and "implement the jvp function" in scorer.note


def test_jvp_takes_the_composite_path_of_fused_attention() -> None:
    case = Case("mha", Attention, lambda b: (torch.randn(b, 5, 4),), _labels(3), "cross_entropy")
    scorer = _jvp_scorer(case)
    assert scorer.method == "jvp" and "composite attention" in scorer.note


def test_api_leaves_model_as_found() -> None:
    model, inputs, targets, refs = _refs(CASES[0])
    model.train()
    model[0].weight.requires_grad_(False)
    grad = torch.full_like(model[2].weight, 3.0)
    model[2].weight.grad = grad.clone()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    for engine in ("hooks", "jvp"):
        gradscope.per_example_influence(model, inputs, targets, *refs, engine=engine)
    assert all(m.training for m in model.modules())
    assert not model[0].weight.requires_grad and model[0].weight.grad is None
    assert torch.equal(model[2].weight.grad, grad)
    assert len(model._forward_hooks) == 1 and not model[0]._forward_hooks and calls


@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=repr)
def test_influence_errors_for_check(case: Case) -> None:
    model, inputs, targets, (ref_inputs, ref_targets) = _refs(case)
    errors = influence_errors(
        Engine(model, resolve_loss(case.loss)), inputs, targets, ref_inputs, ref_targets
    )
    assert set(errors) == {"0", "2", "hooks", "jvp"}
    assert all(e < TOL for e in errors.values()), errors  # NaN: forward mode never ran


@pytest.mark.parametrize("engine", ["hooks", "jvp"])
def test_an_empty_batch_scores_nothing_and_an_empty_reference_is_refused(engine: str) -> None:
    """An empty batch gives (0,) scores as ``per_example_norms`` does (it raised in the
    scorer's sum); an empty reference, whose mean gradient is 0 / 0, is one error, not NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    got = gradscope.per_example_influence(model, x[:0], y[:0], x[:2], y[:2], engine=engine)
    assert got.shape == (0,)
    with pytest.raises(GradscopeError, match="the reference has no examples"):
        gradscope.per_example_influence(model, x, y, x[:0], y[:0], engine=engine)


@pytest.mark.parametrize("factored", [False, True])
def test_a_reference_row_of_no_finite_loss_is_refused_by_the_mean(factored: bool) -> None:
    """A NaN in one REF row made the mean reference gradient NaN and every example's influence
    with it, and the run ended well, naming nothing. The mean refuses it by its row; each row's
    own gradient (``--per-ref``) keeps it to its own column."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    x[4, 1] = float("nan")
    batches = [((x[:3],), y[:3]), ((x[3:],), y[3:])]
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        with pytest.raises(GradscopeError, match=r"^the reference's row 4: its loss is not"):
            reference_gradients(engine, batches, factored=factored)
        each = reference_gradients(engine, batches, per_ref=True, factored=factored)
    for r in each.values():
        r = dense(r)  # (K, *shape), from its factors where factored
        assert not r[4].isfinite().any() and r[:4].isfinite().all()
