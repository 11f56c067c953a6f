"""Rows traced to their examples: routed experts, flattened tokens and sequence-first layouts are
exact on the rules; rows that mix examples go to the fallback with the op named; what one pass
decides holds for the next; single examples are checked on the first batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss
from gradscope.rules import RULES, Dense, register_rule

D, VOCAB, CLASSES = 6, 20, 4


class Experts(nn.Module):
    """A transformers 4.x Mixtral sparse block: nn.Linear experts run on the tokens routed to them
    (top-2 of 4), their outputs index_add-ed back into the flattened (B*T, D) tokens."""

    def __init__(self, experts: int = 4, k: int = 2):
        super().__init__()
        self.k, self.gate = k, nn.Linear(D, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 8), nn.SiLU(), nn.Linear(8, D)) for _ in range(experts)
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = x.view(-1, d)  # (B*T, D)
        weights, chosen = torch.topk(F.softmax(self.gate(h), 1), self.k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        routed = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # (E, k, B*T)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(routed[e])
            y = expert(h[None, token].reshape(-1, d)) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(b, t, d)


class ScatteredExperts(Experts):
    """The same experts, their outputs combined by scatter_add_ (GLM-4-MoE, Llama 4 and others)
    and one scatter_add out of place."""

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = x.view(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(h), 1), self.k, -1)
        out = torch.zeros_like(h)
        routed = F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(routed[e])
            y = expert(h[token]) * weights[token, slot, None]
            where = token[:, None].expand(-1, d)
            if e % 2:
                out.scatter_add_(0, where, y)
            else:
                out = out.scatter_add(0, where, y)
        return out.view(b, t, d)


class MoE(nn.Module):
    def __init__(self, experts: type[nn.Module] = Experts):
        super().__init__()
        self.embed, self.moe, self.head = nn.Embedding(VOCAB, D), experts(), nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.moe(self.embed(ids)).mean(1))


class Flattened(nn.Module):
    """OPT's fc1/fc2: tokens flattened to (B*T, D) around the MLP."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D, 8), nn.Linear(8, D), nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.fc2(torch.tanh(self.fc1(x.reshape(-1, d)))).view(b, t, d)
        return self.head(h.amax(1))


class LibraryRMSNorm(nn.Module):
    """An HF-style RMSNorm (``variance_epsilon``), recognised by structure (``library_norm``)."""

    def __init__(self):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.linspace(0.5, 1.5, D)), 1e-6

    def forward(self, x: Tensor) -> Tensor:
        return (
            self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )


class ShuffledNorm(nn.Module):
    """A library norm on tokens flattened and shuffled (an MoE's dispatch), then put back."""

    def __init__(self):
        super().__init__()
        self.norm, self.head = LibraryRMSNorm(), nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        order = torch.arange(b * t).flip(0)
        h = self.norm(x.reshape(-1, d)[order])[order.argsort()].view(b, t, d)
        return self.head(h.amax(1))


class SequenceFirst(nn.Module):
    """batch_first=False: an Embedding on (T, B) ids and a Linear on (T, B, D)."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.proj(self.embed(ids.t()))  # (T, B, D)
        return self.head(torch.tanh(h).sum(0))  # (B, 3)


class MixesExamples(nn.Module):
    """Subtracts the batch mean: no example's loss is its own."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return self.head(h - h.mean(0, keepdim=True))


def ids(b: int, t: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _check(model: nn.Module, inputs: tuple[Tensor, ...], targets: Tensor, engine: Engine) -> None:
    got = total(engine.norms(inputs, targets).norm_sq).sqrt()
    expected = reference_norms(model, inputs, targets, "cross_entropy")[1]
    assert_rel_close(got, expected, 1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_routed_experts_are_exact_on_the_linear_rule(seed: int):
    """B*T tokens top-2 over 4 experts: an expert often gets exactly B rows (the case that once
    passed a shape probe), and experts not called on the first batch are called on later ones."""
    torch.manual_seed(seed)
    model = MoE().double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for batch in range(3):
            x, y = ids(4, 2, 10 * seed + batch), torch.randint(0, CLASSES, (4,))
            _check(model, (x,), y, engine)
    assert {p.rule for p in engine.plan.params} == {"embedding", "linear"}


def test_experts_combined_by_scatter_add_are_exact_on_rules():
    torch.manual_seed(0)
    model = MoE(ScatteredExperts).double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for batch in range(2):
            x, y = ids(4, 3, batch), torch.randint(0, CLASSES, (4,))
            _check(model, (x,), y, engine)
    assert {p.rule for p in engine.plan.params} == {"embedding", "linear"}


def test_routed_experts_through_fresh_api_calls():
    torch.manual_seed(0)
    model = MoE().double()
    for batch, (b, t) in enumerate([(4, 2), (4, 2), (3, 5), (1, 3)]):
        x, y = ids(b, t, batch), torch.randint(0, CLASSES, (b,))
        got = gradscope.per_example_norms(model, x, y)
        assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


@pytest.mark.parametrize(
    ("model", "make"),
    [
        (Flattened, lambda b, seed: torch.randn(b, 5, D, generator=torch.Generator().manual_seed(seed))),
        (ShuffledNorm, lambda b, seed: torch.randn(b, 5, D, generator=torch.Generator().manual_seed(seed))),
        (SequenceFirst, lambda b, seed: ids(b, 5, seed)),  # T != B
        (SequenceFirst, lambda b, seed: ids(b, b, seed)),  # T == B: only the trace tells
    ],
    ids=["flattened", "shuffled-library-norm", "sequence-first", "sequence-first-t-equals-b"],
)  # fmt: skip
def test_other_layouts_of_rows_are_exact_on_rules(model, make):
    torch.manual_seed(0)
    net = model().double()
    with Engine(net, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):
            x = make(4, seed)
            x = x.double() if x.is_floating_point() else x
            _check(net, (x,), torch.randint(0, 3, (4,)), engine)
    assert_fallback(engine)


def test_a_model_that_mixes_examples_is_refused_with_the_op():
    """Each example's loss is another one alone: no gradient of its own to score."""
    torch.manual_seed(0)
    model = MixesExamples().double()
    x, y = torch.randn(5, D, dtype=torch.float64), torch.randint(0, 3, (5,))
    with (
        Engine(model, resolve_loss("cross_entropy")) as engine,
        pytest.raises(ModelError, match=r"mixes the examples of a batch \(after mean\)"),
    ):
        engine.norms((x,), y)


class WeightFromTheBatch(nn.Module):
    """F.linear(h, h): each example's row against every example's row as the weight."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(D, D), nn.Linear(1, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return self.head(F.linear(h, h).sum(1, keepdim=True))  # (B, B) summed to (B, 1)


def test_a_weight_computed_from_the_batch_mixes_examples():
    torch.manual_seed(0)
    model = WeightFromTheBatch().double()
    x, y = torch.randn(4, D, dtype=torch.float64), torch.randint(0, 3, (4,))
    with (
        Engine(model, resolve_loss("cross_entropy")) as engine,
        pytest.raises(ModelError, match=r"mixes the examples of a batch \(after linear\)"),
    ):
        engine.norms((x,), y)


class EditsOutput(nn.Module):
    """Wav2Vec2's ``hidden[~mask] = 0`` after its feature projection: a layer's output edited in
    place, so the gradient hook on that output never fires."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.proj(x)
        h[~mask] = 0
        return self.head(h.sum(1))


def test_a_second_call_keeps_what_the_first_decided():
    """The first call finds the edited layer's hook never fires and moves it to the fallback; a
    second call (a new Engine) must not serve it with zeros."""
    torch.manual_seed(0)
    model = EditsOutput().double()
    x = torch.randn(3, 4, D, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    y = torch.randint(0, 3, (3,))
    expected = reference_norms(model, (x, mask), y, "cross_entropy")[1]
    for _ in range(3):
        got = gradscope.per_example_norms(model, (x, mask), y)
        assert_rel_close(got, expected, 1e-9)


def test_an_empty_batch_gives_empty_scores():
    model = MoE().double()
    got = gradscope.per_example_norms(model, torch.zeros(0, 3, dtype=torch.long), torch.zeros(0))
    assert got.shape == (0,)


class Swapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


@pytest.fixture
def swapping_rule():
    """A wrong rule whose batch sum is right: each example gets its neighbour's gradient."""

    @register_rule(Swapped, name="swapped")
    def swapped(module, inputs, grad_output):
        return {"scale": Dense((inputs[0] * grad_output).roll(1, 0))}

    yield
    del RULES[Swapped]


def test_an_error_that_cancels_in_the_batch_sum_is_caught(swapping_rule):
    torch.manual_seed(0)
    model = nn.Sequential(Swapped(), nn.Linear(D, 3)).double()
    x, y = torch.randn(4, D, dtype=torch.float64), torch.randint(0, 3, (4,))
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        got = total(engine.norms((x,), y).norm_sq).sqrt()
    assert engine.plan.params[0].rule == "fallback"
    assert "one example" in engine.plan.params[0].note
    assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


class LastState(nn.Module):
    """The usual classifier over an LSTM's last hidden state: the layer's second output."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(D, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _) = self.lstm(x)
        return self.head(out.mean(1) + h[-1])


def test_a_recurrent_layers_last_state_reaching_the_loss_goes_to_the_fallback():
    torch.manual_seed(0)
    model = LastState().double()
    x, y = torch.randn(4, 6, D, dtype=torch.float64), torch.randint(0, 3, (4,))
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        got = total(engine.norms((x,), y).norm_sq).sqrt()
    assert {p.name.split(".")[0] for p in engine.plan.fallback} == {"lstm"}
    assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


class RandomMask(nn.Module):
    """ViT-MAE's random masking in eval mode: a new mask on every forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x * (torch.rand_like(x) > 0.5))


def test_a_random_forward_is_refused_not_scored():
    from gradscope.errors import ModelError

    x, y = torch.randn(4, D), torch.randint(0, 3, (4,))
    with pytest.raises(ModelError, match="random"):
        gradscope.per_example_norms(RandomMask(), x, y)


class Shrinking(nn.Module):
    """A forward that writes its own weight, unseen by autograd's version counter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.fc.weight.data.mul_(0.9)
        return self.fc(x)


def test_a_forward_that_writes_its_weights_is_refused_saying_the_model_changed():
    """The refusal said only "random"; the caller's model is left as the two forwards that
    found it made it (0.81 of its weight): the line says so."""
    from gradscope.errors import ModelError

    torch.manual_seed(0)
    model, x, y = Shrinking(), torch.randn(4, D), torch.randint(0, 3, (4,))
    before = model.fc.weight.detach().clone()
    with pytest.raises(ModelError, match="writes its own weights .* reload the model"):
        gradscope.per_example_norms(model, x, y)
    torch.testing.assert_close(model.fc.weight.detach(), before * 0.81)


class SortedTokens(nn.Module):
    """JetMoE's dispatch: tokens sorted by a key across the batch, a Linear on the sorted rows,
    then put back; a mask made by new_ones (Longformer, LED) on the way."""

    def __init__(self):
        super().__init__()
        self.key, self.fc, self.head = nn.Linear(D, 1), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = x.reshape(-1, d)
        _, order = self.key(h).squeeze(-1).sort()
        y = self.fc(h[order]) * h.new_ones(h.shape[0], 1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0])
        return self.head(torch.tanh(y[back]).view(b, t, d).mean(1))


def test_rows_sorted_across_the_batch_are_exact_on_rules():
    torch.manual_seed(0)
    model = SortedTokens().double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(4, 3, D, generator=g, dtype=torch.float64)
            _check(model, (x,), torch.randint(0, 3, (4,), generator=g), engine)
    assert_fallback(engine)
