"""Raw parameters read in broadcast elementwise ops, served without the fallback, against the loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Case, assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, N = 6, 4


class Tokens(nn.Module):
    """A ViT's front: a cls token expanded and concatenated, positions added, LayerScale."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, N + 1, D))
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.head = nn.Linear(D, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, 3)
        h = self.proj(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed
        h = h + self.gamma * torch.tanh(h)  # LayerScale, parameter on the left
        return self.head(h[:, 0])


class TwiceAndInPlace(nn.Module):
    """One scale read twice (its two uses add up), a bias added in place, a divisor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.shift = nn.Parameter(torch.randn(D))
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: Tensor) -> Tensor:  # (B, 3)
        h = self.fc(x) * self.scale
        h += self.shift
        return (torch.tanh(h) * self.scale) / self.temperature


class OtherElementwise(nn.Module):
    """Parameters in ``where``, ``pow`` (as exponent and as base) and ``minimum`` with the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.floor, self.cap = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))
        self.power = nn.Parameter(torch.linspace(1.0, 2.0, D))
        self.base = nn.Parameter(torch.linspace(1.5, 2.5, D))

    def forward(self, x: Tensor) -> Tensor:  # (B, 3)
        h = self.fc(x)
        h = torch.where(h > 0, h, self.floor)
        h = h.abs() ** self.power + self.base ** torch.tanh(h)
        return torch.minimum(h, self.cap)


class SequenceFirst(nn.Module):
    """(T, B, D) with a (1, 1, D) bias: with T == B only the probe tells positions from examples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, D)
        self.bias = nn.Parameter(torch.randn(1, 1, D))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        h = self.fc(x).transpose(0, 1) + self.bias  # (T, B, D)
        return torch.tanh(h).transpose(0, 1).sum(1)  # (B, D)


class GatedRMSNorm(nn.Module):
    """Qwen3.5's gated RMSNorm, named like a norm but scaled by its gate too: no norm rule, the
    tap serves ``weight * x`` on rows flattened to (B*T*heads, d)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, D // 2))
        self.variance_epsilon = 1e-6

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x * F.silu(gate)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.gate, self.norm = nn.Linear(3, D), nn.Linear(3, D), GatedRMSNorm()

    def forward(self, x: Tensor) -> Tensor:  # (B, N, 3)
        h = self.norm(self.fc(x).reshape(-1, D // 2), self.gate(x).reshape(-1, D // 2))
        return h.reshape(x.shape[0], -1).sum(1, keepdim=True)


def patches(b: int) -> tuple[Tensor, ...]:
    return (torch.randn(b, N, 3),)


def labels(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


CASES = [
    Case("vit-front", Tokens, patches, labels, "cross_entropy"),
    Case("vit-front-batch-1", Tokens, patches, labels, "cross_entropy", batch=1),
    Case("gated-norm", Gated, patches, torch.randn_like),
    Case("twice-and-in-place", TwiceAndInPlace, lambda b: (torch.randn(b, 3),), torch.randn_like),
    Case("other-elementwise", OtherElementwise, lambda b: (torch.randn(b, 3),), torch.randn_like),
]


def _run(case: Case):
    model, inputs, targets = case.build(torch.float64)
    engine = Engine(model, resolve_loss(case.loss))
    with engine:
        scores = engine.norms(inputs, targets)
    for name, norm_sq in scores.norm_sq.items():  # each parameter exact on its own
        _, expected = reference_norms(model, inputs, targets, case.loss, include=[name])
        assert_rel_close(norm_sq.sqrt(), expected, 1e-6)
    assert_fallback(engine)
    return {p.name: p for p in engine.plan.params}


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_broadcast_parameters_match_loop(case: Case):
    plan = _run(case)
    raw = {n: p for n, p in plan.items() if not n.startswith(("proj.", "head.", "fc.", "gate."))}
    assert raw and all(p.rule == "broadcast" and p.note == "" for p in raw.values()), raw


def test_sequence_first_with_length_equal_to_batch_is_served_by_element():
    """(T, B, D) + bias: no row is one example's, every element is; each example's gradient
    sums the elements it owns (with T == B, only the owners tell positions from examples)."""
    plan = _run(
        Case("seq-first", SequenceFirst, lambda b: (torch.randn(b, 5, 3),), torch.randn_like)
    )
    assert plan["bias"].rule == "broadcast" and plan["bias"].note == ""


class Similarities(nn.Module):
    """CLIP's head: a (B, B) similarity of two towers scaled by ``logit_scale.exp()``; each
    example's output is its own diagonal element, or (``mixed``) its row, which mixes them."""

    def __init__(self, mixed: bool = False):
        super().__init__()
        self.text, self.image = nn.Linear(3, D), nn.Linear(3, D)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))
        self.mixed = mixed

    def forward(self, x: Tensor) -> Tensor:  # (B, N, 3)
        sims = self.text(x[:, 0]) @ self.image(x[:, 1]).T * self.logit_scale.exp()  # (B, B)
        return sims.sum(1, keepdim=True) if self.mixed else sims.diagonal()[:, None]


def test_diagonal_of_a_scaled_similarity_is_served_by_element():
    plan = _run(Case("clip", Similarities, patches, torch.randn_like))
    assert plan["logit_scale"].rule == "broadcast" and plan["logit_scale"].note == ""


def test_rows_that_mix_examples_are_refused():
    """Each loss reads its row of the similarity: every example's loss reads the others', so
    no example has a gradient of its own (run alone, it would be another function)."""
    model, inputs, targets = Case("clip-rows", lambda: Similarities(True), patches,
                                  torch.randn_like).build()  # fmt: skip
    engine = Engine(model, resolve_loss("mse"))
    with engine, pytest.raises(ModelError, match="mixes the examples of a batch"):
        engine.norms(inputs, targets)


class NoGradView(nn.Module):
    """A gain read under ``no_grad``, as Mistral Large 4's indexer scores tokens: the tap's view
    of it gets ``requires_grad`` but no gradient function from torch, and no gradient of the gain
    flows; a bias beside it is read as usual."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.bias = nn.Parameter(torch.zeros(D))
        self.fc = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            weights = torch.softmax(x * self.gain, -1)  # (B, D), a constant of the parameters
        return self.fc(torch.tanh(x * weights + self.bias))


def test_a_view_taken_under_no_grad_is_read_by_nothing():
    case = Case("no-grad-view", NoGradView, lambda b: (torch.randn(b, D),), torch.randn_like)
    for seed in range(2):
        model, inputs, targets = case.build(torch.float64, seed=seed)
        norms = gradscope.per_example_norms(model, inputs, targets, loss="mse")
        assert_rel_close(norms, reference_norms(model, inputs, targets, "mse")[1], 1e-9)
