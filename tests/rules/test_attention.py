"""nn.MultiheadAttention and the Transformer layers against the float64 loop: the projections served
where F.linear runs inside attention, the attention rule where add_bias_kv adds a learned key."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from oracle import (
    Case,
    assert_case_matches_loop,
    assert_fallback,
    assert_rel_close,
    reference_influence,
    reference_norms,
)
from torch import Tensor, nn

import gradscope
from gradscope.engine import FALLBACK, Engine
from gradscope.losses import resolve_loss

L, S, E, HEADS = 6, 4, 8, 2  # query positions, memory positions, embedding, heads

# call(attn, h, key, value, lengths) -> attention output; h (queries) and key/value (a memory of
# S positions) are in the module's layout, lengths (B,) the valid memory or sequence positions
AttnCall = Callable[[nn.MultiheadAttention, Tensor, Tensor, Tensor, Tensor], Tensor]


def causal(t: int, dtype: torch.dtype = torch.bool) -> Tensor:
    """(t, t): True, or -inf in a float mask, above the diagonal: where a position sees ahead."""
    ahead = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    return ahead if dtype == torch.bool else torch.zeros(t, t, dtype=dtype).masked_fill(ahead, -1e9)


def padding(lengths: Tensor, t: int) -> Tensor:
    """(B, t) True at the positions past each example's length."""
    return torch.arange(t) >= lengths[:, None]


class Attend(nn.Module):
    """Linear layers in, one MultiheadAttention called as ``call`` says, a Linear head out."""

    def __init__(self, call: AttnCall, batch_first: bool = True, kdim: int = E, vdim: int = E,
                 **mha: object):  # fmt: skip
        super().__init__()
        self.call, self.batch_first = call, batch_first
        self.inp, self.key, self.value = nn.Linear(5, E), nn.Linear(5, kdim), nn.Linear(5, vdim)
        self.attn = nn.MultiheadAttention(
            E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim, **mha
        )
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))  # (B, L, E)
        key, value = torch.tanh(self.key(x[:, :S])), torch.tanh(self.value(x[:, :S]))
        if not self.batch_first:
            h, key, value = (t.transpose(0, 1) for t in (h, key, value))
        out = self.call(self.attn, h, key, value, lengths)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)  # (B, L, 3)


def self_attn(**kwargs: object) -> AttnCall:
    return lambda attn, h, k, v, lengths: attn(h, h, h, **kwargs)[0]


def padded_self(mask: Tensor | None = None, **kwargs: object) -> AttnCall:
    return lambda attn, h, k, v, lengths: attn(
        h, h, h, key_padding_mask=padding(lengths, L), attn_mask=mask, **kwargs
    )[0]


def cross(padded: bool = False) -> AttnCall:
    return lambda attn, h, k, v, lengths: attn(
        h, k, v, key_padding_mask=padding(lengths, S) if padded else None, need_weights=False
    )[0]


def alibi_3d(attn: nn.MultiheadAttention, h: Tensor, k: Tensor, v: Tensor, lengths: Tensor):
    """A (B*H, L, L) float mask: a distance penalty per head, padding per example."""
    b = lengths.shape[0]
    slopes = torch.tensor([0.5, 0.25], dtype=h.dtype)[:, None, None]  # (H, 1, 1)
    pos = torch.arange(L, dtype=h.dtype)
    mask = -slopes * (pos[:, None] - pos[None]).abs()  # (H, L, L)
    mask = mask.masked_fill(padding(lengths, L)[:, None, None], float("-inf"))  # (B, H, L, L)
    return attn(h, h, h, attn_mask=mask.reshape(b * HEADS, L, L))[0]


def positional(attn: nn.MultiheadAttention, h: Tensor, k: Tensor, v: Tensor, lengths: Tensor):
    """The padding mask and need_weights passed positionally, the mask by keyword."""
    return attn(h, h, h, padding(lengths, L), False, attn_mask=causal(L))[0]


def lengths_input(b: int) -> tuple[Tensor, Tensor]:
    # at least 2 valid positions: a causal row or padded memory is never fully masked
    return torch.randn(b, L, 5), torch.randint(2, S + 1, (b,))


def like(out: Tensor) -> Tensor:
    return torch.randn_like(out)


def attend(call: AttnCall, **kwargs: object) -> Callable[[], nn.Module]:
    return lambda: Attend(call, **kwargs)


class Encoder(nn.Module):
    """nn.TransformerEncoder over a padded, causal sequence: self_attn is called with kwargs."""

    def __init__(self, norm_first: bool, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(5, E)
        layer = nn.TransformerEncoderLayer(
            E, HEADS, 16, dropout=0.1, batch_first=batch_first, norm_first=norm_first
        )
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.enc(h, mask=causal(L), src_key_padding_mask=padding(lengths, L), is_causal=True)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h.mean(1))  # (B, 3)


class Decoder(nn.Module):
    """nn.TransformerDecoderLayer: causal self-attention, cross-attention on a padded memory."""

    def __init__(self):
        super().__init__()
        self.inp, self.mem = nn.Linear(5, E), nn.Linear(5, E)
        self.dec = nn.TransformerDecoderLayer(E, HEADS, 16, batch_first=True)
        self.head = nn.Linear(E, 3)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        memory = self.mem(x[:, :S])  # (B, S, E)
        return self.head(
            self.dec(
                self.inp(x), memory, tgt_mask=causal(L, x.dtype), tgt_is_causal=True,
                memory_key_padding_mask=padding(lengths, S),
            )
        )  # fmt: skip


def classes(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


CASES = [
    Case("self-batch-first", attend(self_attn()), lengths_input, like),
    Case("self-seq-first", attend(self_attn(), batch_first=False), lengths_input, like),
    # L == B: only the probe can tell positions from examples, and it must look along dim 1
    Case("self-seq-first-l-equals-b", attend(self_attn(), batch_first=False), lengths_input, like,
         batch=L),
    Case("self-batch-1", attend(self_attn()), lengths_input, like, batch=1),
    Case("causal-float", attend(lambda attn, h, k, v, n: attn(
        h, h, h, attn_mask=causal(L, h.dtype))[0]), lengths_input, like),
    Case("causal-bool", attend(self_attn(attn_mask=causal(L))), lengths_input, like),
    # the hint alone: torch drops the mask and runs causal attention (need_weights=False)
    Case("is-causal-hint", attend(self_attn(attn_mask=causal(L), is_causal=True,
                                            need_weights=False)), lengths_input, like),
    # the hint wins over the mask it comes with, whatever that mask holds
    Case("is-causal-hint-over-zero-mask", attend(lambda attn, h, k, v, n: attn(
        h, h, h, attn_mask=torch.zeros(L, L, dtype=h.dtype), is_causal=True,
        need_weights=False)[0]), lengths_input, like),
    # with a padding mask the hint is dropped and the merged mask is used
    Case("is-causal-padded", attend(padded_self(causal(L), is_causal=True, need_weights=False)),
         lengths_input, like),
    Case("padding-bool", attend(padded_self()), lengths_input, like),
    Case("padding-causal-seq-first", attend(padded_self(causal(L)), batch_first=False),
         lengths_input, like),
    Case("padding-float", attend(lambda attn, h, k, v, n: attn(
        h, h, h, key_padding_mask=padding(n, L).to(h.dtype) * -1e4)[0]), lengths_input, like),
    Case("mask-3d-per-head", attend(alibi_3d), lengths_input, like),
    Case("positional-arguments", attend(positional), lengths_input, like),
    Case("cross", attend(cross()), lengths_input, like),
    Case("cross-padded-seq-first", attend(cross(True), batch_first=False), lengths_input, like),
    Case("kdim-vdim", attend(cross(True), kdim=3, vdim=7), lengths_input, like),
    Case("no-bias", attend(padded_self(), bias=False), lengths_input, like),
    Case("bias-kv-zero-attn", attend(padded_self(causal(L)), add_bias_kv=True,
                                     add_zero_attn=True), lengths_input, like),
    Case("bias-kv-cross-seq-first", attend(cross(True), add_bias_kv=True, batch_first=False),
         lengths_input, like),
    Case("encoder-post-norm", lambda: Encoder(False), lengths_input, classes, "cross_entropy"),
    Case("encoder-pre-norm", lambda: Encoder(True), lengths_input, classes, "cross_entropy"),
    Case("encoder-seq-first", lambda: Encoder(True, False), lengths_input, classes,
         "cross_entropy"),
    Case("decoder", Decoder, lengths_input, like),
    Case("decoder-batch-1", Decoder, lengths_input, like, batch=1),
]  # fmt: skip

BY_ID = {case.id: case for case in CASES}
MHA_PARAMS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
              "bias_k", "bias_v", "out_proj.weight", "out_proj.bias")  # fmt: skip


RAW = {"broadcast", "linear"}  # in-projections read by the tap, out_proj by its Linear rule


def _is_mha_param(name: str) -> bool:
    return "attn" in name and name.endswith(MHA_PARAMS)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_norms_match_loop(case: Case) -> None:
    model, inputs, targets = case.build(torch.float64)
    _, expected = reference_norms(model, inputs, targets, case.loss)
    engine = Engine(model, resolve_loss(case.loss))
    plan = engine.plan
    with engine:
        scores = engine.norms(inputs, targets)
    got = torch.stack(list(scores.norm_sq.values())).sum(0).sqrt()
    assert_rel_close(got, expected, 1e-5)
    assert_fallback(engine)
    served = {p.name: p.rule for p in plan.params if _is_mha_param(p.name)}
    # add_bias_kv: the attention rule; else the projections where F.linear reads them
    learned_key = any(n.endswith("bias_k") for n in served)
    assert served and set(served.values()) <= ({"attention"} if learned_key else RAW), served


@pytest.mark.parametrize("case_id", ["self-seq-first", "kdim-vdim", "bias-kv-zero-attn", "decoder"])
def test_each_parameter_matches_loop(case_id: str) -> None:
    """Per parameter, so a wrong block of the packed weight cannot hide in the total."""
    case = BY_ID[case_id]
    model, inputs, targets = case.build(torch.float64)
    engine = Engine(model, resolve_loss(case.loss))
    plan = engine.plan
    with engine:
        scores = engine.norms(inputs, targets)
    for name in (p.name for p in plan.params if _is_mha_param(p.name)):
        _, expected = reference_norms(model, inputs, targets, case.loss, include=[name])
        assert expected.min() > 0, name
        assert_rel_close(scores.norm_sq[name].sqrt(), expected, 1e-5)
    assert_fallback(engine)


@pytest.mark.parametrize("case_id", ["causal-bool", "cross-padded-seq-first", "encoder-pre-norm"])
def test_float32(case_id: str) -> None:
    assert_case_matches_loop(BY_ID[case_id], torch.float32, 1e-4)


@pytest.mark.parametrize("engine", ["hooks", "jvp"])
@pytest.mark.parametrize("case_id", ["cross-padded-seq-first", "encoder-post-norm", "decoder"])
def test_influence_matches_loop(case_id: str, engine: str) -> None:
    case = BY_ID[case_id]
    model, inputs, targets = case.build(torch.float64, batch=7)
    train = (tuple(t[:4] for t in inputs), targets[:4])
    ref = (tuple(t[4:] for t in inputs), targets[4:])
    got = gradscope.per_example_influence(model, *train, *ref, case.loss, engine=engine)
    expected, _, _ = reference_influence(model, *train, ref, case.loss)
    assert_rel_close(got, expected[:, 0], 1e-5)
    assert_fallback(model)


class WeightsInLoss(nn.Module):
    """The attention weights join the output: a path to the loss beside the attention output."""

    def __init__(self, add_bias_kv: bool = False):
        super().__init__()
        self.inp = nn.Linear(5, E)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, add_bias_kv=add_bias_kv)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        out, weights = self.attn(h, h, h)  # (B, L, E), (B, L, L)
        return out.sum(-1) + weights.sum(-1) * weights[..., 0]  # (B, L)


class Unbatched(nn.Module):
    """One unbatched (L, E) call per example: the call's rows are positions, not examples."""

    def __init__(self):
        super().__init__()
        self.inp, self.attn = nn.Linear(5, E), nn.MultiheadAttention(E, HEADS)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return torch.stack([self.attn(t, t, t)[0] for t in h])  # (B, L, E)


@pytest.mark.parametrize(
    ("module", "note"),
    [
        (WeightsInLoss, ""),  # the projections are served where F.linear runs inside attention
        (Unbatched, ""),  # each call's rows traced to their one example
        (functools.partial(WeightsInLoss, add_bias_kv=True), "attention weights"),  # module rule
    ],
    ids=["weights", "unbatched", "weights-bias-kv"],
)
def test_paths_beside_the_attention_output(module: Callable[[], nn.Module], note: str) -> None:
    """Exact either way: served where the functions run, or on the fallback with the reason
    where the module rule (``add_bias_kv``) cannot follow a second output to the loss."""
    case = Case("paths", module, lengths_input, like)
    model, inputs, targets = case.build(torch.float64)
    engine = Engine(model, resolve_loss("mse"))
    plan = engine.plan
    with engine:
        scores = engine.norms(inputs, targets)
    for p in plan.params:
        _, expected = reference_norms(model, inputs, targets, include=[p.name])
        assert_rel_close(scores.norm_sq[p.name].sqrt(), expected, 1e-5)
        if p.name.startswith("attn.") and note:
            assert p.rule == FALLBACK and note in p.note, (p.name, p.rule, p.note)
        else:
            assert p.rule in RAW, (p.name, p.rule, p.note)


@pytest.mark.parametrize(
    "case_id", ["self-seq-first", "cross-padded-seq-first", "encoder-pre-norm"]
)
def test_two_batches_of_one_shape_through_fresh_calls(case_id: str) -> None:
    """The projections served through the tap stay exact on a second batch of the same shape,
    where the first batch's decisions are replayed without a self-check: a fresh API call each."""
    assert_case_matches_loop(BY_ID[case_id], torch.float64, 1e-9)
