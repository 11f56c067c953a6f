"""What the first batch decides: the self-check and expanded shared lookups; and the columns
``observe`` reads from the scoring forward, in both influence engines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Case, assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, Influence, reference_gradients
from gradscope.losses import resolve_loss
from gradscope.rules import RULES, Rule

VOCAB, D, T = 11, 6, 5


class DirectTied(nn.Module):
    """The embedding's weight also read directly as the output head: no hook sees that use."""

    def __init__(self):
        super().__init__()
        self.wte, self.mix = nn.Embedding(VOCAB, D), nn.Linear(D, D)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.tanh(self.mix(self.wte(ids))) @ self.wte.weight.T  # (B, T, V)


class Positions(nn.Module):
    """Learned positions looked up once for the batch, as nanoGPT (``arange(T)``) and BERT
    (``position_ids`` of shape (1, T)) do."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1])
        positions = positions if self.shape == "arange" else positions[None]  # (T,) or (1, T)
        return self.head(torch.tanh(self.wte(ids) + self.wpe(positions)))


class Collapses(nn.Module):
    """Sums the looked-up positions over their leading dimension: the expanded call would change
    the model, so it must run as written."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        pos = self.wpe(torch.arange(ids.shape[1])[None]).sum(0)  # (T, D)
        return self.head(torch.tanh(self.wte(ids) + pos))


class SeparateProjections(nn.Module):
    """Self-attention with its own key Linear, as BERT builds it: the key bias's gradient is zero
    but for rounding (softmax cancels a constant added to a query's scores)."""

    def __init__(self):
        super().__init__()
        self.wte, self.q, self.k, self.v = (
            nn.Embedding(VOCAB, D),
            *(nn.Linear(D, D) for _ in "qkv"),
        )
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.wte(ids)
        return self.head(F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h)))


def tokens(b: int) -> tuple[Tensor, ...]:
    return (torch.randint(0, VOCAB, (b, T)),)


def next_tokens(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


def _run(case: Case, batch: int | None = None):
    model, inputs, targets = case.build(torch.float64, batch)
    engine = Engine(model, resolve_loss(case.loss))
    with engine:
        scores = engine.norms(inputs, targets)
    got = torch.stack(list(scores.norm_sq.values())).sum(0).sqrt()
    assert_rel_close(got, reference_norms(model, inputs, targets, case.loss)[1], 1e-6)
    return {p.name: p for p in engine.plan.params}


def test_weight_also_read_outside_its_module_is_served_there_too():
    """The embedding's rule serves its call, the tap the ``h @ W.T`` read: both parts merge."""
    case = Case("direct-tied", DirectTied, tokens, next_tokens, "cross_entropy")
    plan = _run(case)
    assert plan["wte.weight"].rule == "embedding", plan["wte.weight"].note
    assert plan["mix.weight"].rule == plan["mix.bias"].rule == "linear"
    model, inputs, targets = case.build(torch.float64)
    with Engine(model, resolve_loss(case.loss)) as engine:
        got = engine.norms(inputs, targets).norm_sq["wte.weight"].sqrt()
    _, expected = reference_norms(model, inputs, targets, case.loss, include=["wte.weight"])
    assert_rel_close(got, expected, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradient_zero_but_for_rounding_stays_on_its_rule(dtype: torch.dtype):
    case = Case("key-bias", SeparateProjections, tokens, next_tokens, "cross_entropy", batch=6)
    model, inputs, targets = case.build(dtype)
    engine = Engine(model, resolve_loss(case.loss))
    with engine:
        engine.norms(inputs, targets)
    assert {p.rule for p in engine.plan.params} == {"embedding", "linear"}, engine.plan.describe()


@pytest.mark.parametrize("shape", ["arange", "row"])
@pytest.mark.parametrize("batch", [1, 4])
def test_positions_shared_by_the_batch_are_served_by_the_rule(shape: str, batch: int):
    case = Case(
        f"positions-{shape}", lambda: Positions(shape), tokens, next_tokens, "cross_entropy"
    )
    plan = _run(case, batch)
    assert {p.rule for p in plan.values()} == {"embedding", "linear"}, plan


class FirstCopy(nn.Module):
    """A bias table computed once for the batch by a Linear on shared (1, T, 2) coordinates, of
    which the model reads copy 0 (as Swin V2's continuous position bias does): expanded to the
    batch, every example's loss goes through example 0's copy."""

    def __init__(self):
        super().__init__()
        self.wte, self.mlp, self.head = nn.Embedding(VOCAB, D), nn.Linear(2, D), nn.Linear(D, VOCAB)
        self.register_buffer("coords", torch.linspace(-1, 1, 2 * T).view(1, T, 2))

    def forward(self, ids: Tensor) -> Tensor:
        bias = self.mlp(self.coords)[0]  # (T, D)
        return self.head(torch.tanh(self.wte(ids) + bias))


def _expanded(case: Case) -> bool:
    """Whether the first batch kept the shared call's rows expanded."""
    model, inputs, targets = case.build(torch.float64)
    engine = Engine(model, resolve_loss(case.loss))
    with engine:
        engine.norms(inputs, targets)
    return engine.record.at(inputs, targets).expand


def test_expansion_that_makes_the_losses_mix_is_not_kept():
    """The expanded rows keep every loss as it was, yet the losses mix: run as written, the
    shared call's output is followed as computed from its parameters, and stays exact."""
    case = Case("first-copy", FirstCopy, tokens, next_tokens, "cross_entropy")
    plan = _run(case)
    assert all(p.note == "" for p in plan.values()), {n: p.note for n, p in plan.items()}
    assert plan["mlp.weight"].rule == "linear" and plan["wte.weight"].rule == "embedding"
    assert _expanded(case) is False


def test_expansion_that_would_change_the_model_is_not_kept():
    case = Case("collapses", Collapses, tokens, next_tokens, "cross_entropy")
    plan = _run(case)
    assert plan["wpe.weight"].rule == "embedding" and plan["wpe.weight"].note == ""
    assert _expanded(case) is False


def _predicted(output: Tensor, targets: Tensor) -> dict[str, Tensor]:
    return {"pred": output.argmax(-1), "target_logit": output.gather(1, targets[:, None])[:, 0]}


@pytest.mark.parametrize("method", ["hooks", "jvp", "norms"])
def test_observe_reads_the_scoring_forward(method: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    engine = Engine(model, resolve_loss("cross_entropy"), observe=_predicted)
    with engine:
        if method == "norms":
            observed = engine.norms((x,), y).observed
        else:
            refs = reference_gradients(engine, [((x[:2],), y[:2])])
            observed = Influence(engine, refs, method, norms=False)((x,), y).observed
    with torch.no_grad():
        expected = _predicted(model(x), y)
    assert observed.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(observed[key], value)


def test_influence_only_computes_no_norms():
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        refs = reference_gradients(engine, [((x,), y)])
        scores = Influence(engine, refs, "hooks", norms=False)((x,), y)
    assert scores.norm_sq is None
    expected = F.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(scores.loss, expected.detach())


def test_rule_that_raises_declines_and_the_fallback_serves(monkeypatch):
    """A layer recognised wrongly may make its rule fail (a reshape that does not fit): the
    rule declines, its parameters move to the fallback with the reason, and stay exact."""

    def broken(module, inputs, grad_output):
        raise RuntimeError("shape '[5, -1, 7]' is invalid for input of size 30")

    monkeypatch.setitem(RULES, nn.Embedding, Rule("embedding", broken))
    plan = _run(
        Case("positions", lambda: Positions("arange"), tokens, next_tokens, "cross_entropy")
    )
    assert plan["wte.weight"].rule == plan["wpe.weight"].rule == "fallback"
    assert plan["wte.weight"].note.startswith("its rule failed: RuntimeError: shape")
    assert plan["head.weight"].rule == "linear"


def test_a_first_batch_whose_gradients_are_not_finite_checks_nothing():
    """An inf input through tanh gives a finite loss and a NaN gradient (0 * inf): the
    self-check cannot compare there, so it waits for a batch where it can, and no rule is
    sent to the fallback for it; the finite rows are exact on both batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3)).double()
    x, y = torch.randn(8, D, dtype=torch.float64), torch.randint(0, 3, (8,))
    x[1, 0] = float("inf")
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for rows in (slice(0, 4), slice(4, 8)):
            scores = engine.norms((x[rows],), y[rows])
            got = torch.stack(list(scores.norm_sq.values())).sum(0).sqrt()
            finite = got.isfinite()
            expected = reference_norms(model, (x[rows],), y[rows], "cross_entropy")[1]
            assert_rel_close(got[finite], expected[finite], 1e-9)
    assert_fallback(engine)
    assert engine.record.at((x[4:],), y[4:]).verified  # on the second batch
