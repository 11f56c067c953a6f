"""Parameters read by functions outside any rule's module, whole or through views: a Linear
subclass with its own forward, a scaled embedding, a router's F.linear, fused 3-D expert weights
indexed per expert, a packed weight chunked, ``(1 + w)`` norms. Each on the rules, exact against
the float64 loop on two batches, through a fresh API call and one Engine alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import BROADCAST, Engine, total
from gradscope.engine.analysis.owners import rows_of
from gradscope.engine.rows import regroup
from gradscope.losses import resolve_loss

D, H, VOCAB, CLASSES, T = 6, 8, 20, 3, 5


class OwnLinear(nn.Linear):
    """Falcon's FalconLinear: ``x @ W.T`` then the bias, its own forward."""

    def forward(self, x: Tensor) -> Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class ScaledEmbedding(nn.Embedding):
    """Gemma's, BART's scaled word embeddings."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * D**0.5


class OnePlusNorm(nn.Module):
    """Gemma's RMSNorm: the weight read as ``1 + w`` in float32."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return out * (1.0 + self.weight.float())


class FusedExperts(nn.Module):
    """transformers 5's Mixtral experts: 3-D weights, ``F.linear(x, W[e])`` on routed tokens,
    a raw router weight read by ``F.linear``."""

    def __init__(self, experts: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Parameter(torch.randn(experts, D) * 0.5)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * H, D) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, D, H) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = x.reshape(-1, d)
        probs = F.softmax(F.linear(h, self.router.type(h.dtype)), -1)  # GLM-4-MoE casts it
        weights, chosen = torch.topk(probs, self.k, -1)
        out = torch.zeros_like(h)
        mask = F.one_hot(chosen, self.router.shape[0]).permute(2, 1, 0)
        for e in mask.sum((-1, -2)).nonzero():
            e = e[0]
            slot, token = torch.where(mask[e])
            gate, up = F.linear(h[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view(b, t, d)


class Packed(nn.Module):
    """One packed (3D, D) weight chunked into three projections, each used by F.linear."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3 * D, D) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv.chunk(3)
        return torch.tanh(F.linear(x, q)) * F.linear(x, k) + F.linear(x, v)


class Overlapping(nn.Module):
    """One raw weight read whole and through a slice of its columns: the two reads overlap."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(F.linear(x, self.w)) + F.linear(x[..., :3], self.w[:, :3])


class Model(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.embed, self.norm = ScaledEmbedding(VOCAB, D), OnePlusNorm()
        self.block, self.out = block, OwnLinear(D, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.block(self.norm(self.embed(ids))).mean(1))


BLOCKS = {
    "fused-experts": FusedExperts,
    "packed": Packed,
    "own-linear": lambda: OwnLinear(D, D),
    "overlapping": Overlapping,
}


def batch(b: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(
        0, CLASSES, (b,), generator=g
    )


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_functional_reads_are_exact_on_rules(block: str):
    torch.manual_seed(0)
    model = Model(BLOCKS[block]()).double()
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for seed in range(2):
            ids, y = batch(4, seed)
            got = total(engine.norms((ids,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-6)
    assert {p.rule for p in engine.plan.params} == {BROADCAST}, [
        (p.name, p.note) for p in engine.plan.fallback
    ]
    for seed in range(2, 4):  # fresh calls, another batch size too
        ids, y = batch(3 + seed % 2, seed)
        got = gradscope.per_example_norms(model, ids, y)
        assert_rel_close(got, reference_norms(model, (ids,), y, "cross_entropy")[1], 1e-6)


def test_influence_through_placed_views_matches_the_loop():
    """Inner products with a reference gradient read each expert's slice of it."""
    torch.manual_seed(1)
    model = Model(FusedExperts()).double()
    ids, y = batch(4, 0)
    ref_ids, ref_y = batch(3, 9)
    got = gradscope.per_example_influence(model, ids, y, ref_ids, ref_y, engine="hooks")
    ref_model = model
    loss = resolve_loss("cross_entropy")
    params = list(ref_model.parameters())
    ref_grad = torch.autograd.grad(loss(ref_model(ref_ids), ref_y).mean(), params)
    expected = []
    for i in range(4):
        g = torch.autograd.grad(loss(ref_model(ids[i : i + 1]), y[i : i + 1]).sum(), params)
        expected.append(sum((a * b).sum() for a, b in zip(g, ref_grad, strict=True)))
    assert_rel_close(got, torch.stack(expected), 1e-6)


@pytest.mark.parametrize("batch", [1, 3])
def test_regroup_of_a_batch_dimension_is_the_gather(batch: int):
    """Rows whose owners read 0..B-1 along one dimension (sequence-first) are moved, not
    gathered: the same (B, L, features) as the general gather."""
    x = torch.randn(5, batch, 2, 4)  # (T, B, H, features)
    owner = torch.arange(batch).view(1, batch, 1).expand(5, batch, 2)
    moved = regroup(rows_of(owner, batch), batch, x)[0][0]
    gathered = regroup(rows_of(owner.contiguous(), batch), batch, x)[0][
        0
    ]  # not an expanded view: the gather
    assert torch.equal(moved, gathered)


class TiedHead(nn.Module):
    """BERT's LM head: the decoder's weight is the embedding's, its bias a parameter of the head
    around it (no rule): in the decoder's call the rule serves the weight, the tap the bias."""

    def __init__(self):
        super().__init__()
        self.wte, self.decoder = nn.Embedding(11, 6), nn.Linear(6, 11)
        self.bias = nn.Parameter(torch.randn(11))
        self.decoder.weight, self.decoder.bias = self.wte.weight, self.bias

    def forward(self, ids: Tensor) -> Tensor:
        return self.decoder(torch.tanh(self.wte(ids)))


def test_a_call_whose_weight_its_rule_serves_and_bias_the_tap():
    model = TiedHead().double().eval()
    ids = torch.randint(0, 11, (4, 5))
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        got = engine.norms((ids,), ids).norm_sq
    assert_fallback(engine)
    for name, norm_sq in got.items():
        _, expected = reference_norms(model, (ids,), ids, "cross_entropy", include=[name])
        assert_rel_close(norm_sq.sqrt(), expected, 1e-9)
