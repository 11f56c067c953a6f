"""Layer rules against the float64 per-example loop: norms, materialised grads, inner products."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import families as fam
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import Case, alone, assert_case_matches_loop, assert_fallback, assert_rel_close
from torch import Tensor, nn

import gradscope
import gradscope.engine.backward.batched as batched_module
import gradscope.rules.base as base
import gradscope.rules.conv as conv
import gradscope.rules.embedding as embedding
import gradscope.rules.ghost as ghost
import gradscope.rules.outer as outer
from gradscope.engine import Engine, Forward, naive_grads
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss
from gradscope.rules import MATCHERS, NAMED, RULES, find_rule
from gradscope.rules.conv import unfold
from gradscope.rules.formed import Formed


def randn(*shape: int):
    return lambda b: (torch.randn(b, *shape),)


def ids(high: int, *shape: int):
    return lambda b: (torch.randint(0, high, (b, *shape)),)


def like(out: Tensor) -> Tensor:
    return torch.randn_like(out)


def classes(out: Tensor) -> Tensor:
    return torch.randint(0, out.shape[-1], out.shape[:-1])


def net(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


def stats(bn: nn.Module) -> nn.Module:
    """Random running statistics and affine parameters, so none of them is the trivial 0 or 1."""
    with torch.no_grad():
        if getattr(bn, "running_mean", None) is not None:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
        for p in bn.parameters():
            p.normal_()
    return bn


def zero_entry(norm: nn.Module) -> nn.Module:
    """A weight with one entry 0: that entry's output is the bias alone, its gradient not 0."""
    with torch.no_grad():
        norm.weight.view(-1)[1] = 0.0
    return norm


class SubLinear(nn.Linear):
    """Keeps nn.Linear's forward, so the Linear rule serves it."""


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """SqueezeBERT's LayerNorm: (B, C, L) permuted to put the channels last, normalised, and
    back."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 1)).permute(0, 2, 1)


class Twice(nn.Module):
    """One Linear applied twice: its two calls' contributions add before the norm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class SequenceFirst(nn.Module):
    """A recurrent layer with batch_first=False, on (B, T, D) turned to (T, B, D) and back."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        out, h = self.rnn(x.transpose(0, 1))
        return out.transpose(0, 1), h


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


class Concatenated(nn.Module):
    """Linears on (B, T, 3) whose outputs are concatenated behind another tensor: along the
    positions behind a token (a ViT's class token), or along the batch behind another Linear's
    (B, T, 6). Each one's output gradient is a slice of the concatenation's that begins past
    the start of its memory where it is contiguous: at batch 1, and along the batch at any."""

    def __init__(self, along_batch: bool):
        super().__init__()
        self.along_batch = along_batch
        self.a, self.b, self.head = nn.Linear(3, 6), nn.Linear(3, 6), nn.Linear(6, 2)
        self.register_buffer("token", torch.randn(1, 1, 6))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 3)
        n = x.shape[0]
        if self.along_batch:
            h = torch.cat([self.a(x), self.b(x)], 0)  # (2B, T, 6)
            h = h[:n] * h[n:]
        else:
            h = torch.cat([self.token.expand(n, -1, -1), self.a(x)], 1)[:, 1:] * self.b(x)
        return self.head(torch.tanh(h).mean(1))


class TwoLookups(nn.Module):
    """One Embedding looked up for two index tensors: the same rows can be hit by both calls."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 4), nn.Linear(4, 2)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.out(torch.tanh(self.emb(a) + 2 * self.emb(b)))


class TiedLM(nn.Module):
    """Input embedding and output head share one (V, D) weight: an Embedding and a Linear.

    ``head_first`` registers the head first, so the shared weight's first owner is the Linear and
    the merge starts from an Outer instead of a Rows.
    """

    def __init__(self, vocab: int = 9, dim: int = 4, head_first: bool = False, last: bool = False):
        super().__init__()
        self.last = last  # the head reads the last position only, and id 0 is padding
        if head_first:
            self.head = nn.Linear(dim, vocab, bias=False)
        self.emb = nn.Embedding(vocab, dim, padding_idx=0 if last else None)
        self.mix = nn.Linear(dim, dim)
        if not head_first:
            self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mix(self.emb(x)))
        return self.head(h[:, -1] if self.last else h)


def conv_head(conv: nn.Module, *after: nn.Module) -> nn.Sequential:
    return net(conv, *after, nn.Flatten(), nn.LazyLinear(2))


def transformers_layer(path: str, *args: object) -> Callable[[], nn.Module]:
    """A layer class of ``transformers`` ("pytorch_utils.Conv1D"), built when the case runs."""

    def build() -> nn.Module:
        pytest.importorskip("transformers")
        module, _, name = f"transformers.{path}".rpartition(".")
        return getattr(importlib.import_module(module), name)(*args)

    return build


CASES = [
    # Linear: one position, sequences, rank-4, both branches of Outer.norm_sq
    Case("linear-2d", lambda: net(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)), randn(7), like),
    Case("linear-2d-nobias", lambda: nn.Linear(7, 3, bias=False), randn(7), like),
    Case("linear-seq-gram", lambda: nn.Linear(16, 16), randn(3, 16), like),
    Case("linear-seq-materialise", lambda: nn.Linear(3, 2, bias=False), randn(20, 3), like),
    Case("linear-rank4", lambda: nn.Linear(4, 5), randn(2, 3, 4), like),
    Case(
        "linear-subclass",
        lambda: net(SubLinear(5, 4), nn.Tanh(), nn.Linear(4, 3)),
        randn(5),
        classes,
        loss="cross_entropy",
    ),
    Case("linear-called-twice", Twice, randn(3, 6), like),
    Case("linear-unused-module", Unused, randn(4), like),
    Case("linear-behind-a-token-batch-1", lambda: Concatenated(False), randn(4, 3), like, batch=1),
    Case("linear-concatenated-along-the-batch", lambda: Concatenated(True), randn(4, 3), like),
    # Conv: every padding_mode, "same"/"valid", stride, dilation, groups, 1-3 spatial dims
    Case(
        "conv1d-reflect-stride-dilation-groups",
        lambda: nn.Conv1d(
            4, 6, 3, stride=2, padding=2, dilation=2, groups=2, padding_mode="reflect"
        ),
        randn(4, 11),
        like,
    ),
    Case(
        "conv1d-zeros-stride", lambda: nn.Conv1d(3, 4, 4, stride=3, padding=1), randn(3, 13), like
    ),
    Case(
        "conv2d-circular-same-groups",
        lambda: nn.Conv2d(
            3, 6, (3, 2), padding="same", dilation=(1, 2), groups=3, padding_mode="circular"
        ),
        randn(3, 7, 8),
        like,
    ),
    Case(
        "conv2d-zeros-same-even-kernel",
        lambda: nn.Conv2d(3, 5, 4, padding="same", dilation=2),
        randn(3, 9, 6),
        like,
    ),
    Case(
        "conv2d-depthwise-valid-nobias",
        lambda: nn.Conv2d(4, 4, 3, padding="valid", groups=4, bias=False),
        randn(4, 5, 5),
        like,
    ),
    Case(
        "conv2d-batch-1",
        lambda: nn.Conv2d(2, 3, (2, 3), stride=(2, 1), padding=(1, 0)),
        randn(2, 5, 7),
        like,
        batch=1,
    ),
    Case(
        "conv2d-zeros-stride-dilation-groups-batch-3",
        lambda: nn.Conv2d(4, 6, 3, stride=(2, 1), padding=(2, 1), dilation=2, groups=2),
        randn(4, 9, 8),
        like,
        batch=3,
    ),
    Case(
        "conv3d-replicate",
        lambda: nn.Conv3d(
            2, 4, (2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 2), padding_mode="replicate"
        ),
        randn(2, 5, 6, 4),
        like,
    ),
    Case(
        "conv-transpose1d-output-padding",
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1),
        randn(4, 7),
        like,
    ),
    Case(
        "conv-transpose2d-groups-dilation",
        lambda: nn.ConvTranspose2d(
            4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2
        ),
        randn(4, 5, 6),
        like,
    ),
    Case(
        "conv-transpose3d-no-bias-batch-1",
        lambda: nn.ConvTranspose3d(2, 4, 2, stride=2, bias=False),
        randn(2, 3, 3, 2),
        like,
        batch=1,
    ),
    Case("rnn-tanh", lambda: nn.RNN(4, 5, batch_first=True), randn(6, 4), like, output=0),
    Case(
        "rnn-relu-sequence-first-no-bias",
        lambda: SequenceFirst(nn.RNN(4, 5, nonlinearity="relu", bias=False)),
        randn(6, 4),  # (B, 6, 4) run as (6, B, 4)
        like,
        output=0,
    ),
    Case(
        "gru-2-layers-bidirectional",
        lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=True),
        randn(6, 4),
        like,
        output=0,
    ),
    Case(
        "lstm-batch-1",
        lambda: nn.LSTM(4, 5, batch_first=True),
        randn(7, 4),
        like,
        output=0,
        batch=1,
    ),  # fmt: skip
    Case(
        "lstm-2-layers-bidirectional",
        lambda: nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True),
        randn(5, 4),
        like,
        output=0,
    ),
    Case("embedding-bag-sum", lambda: nn.EmbeddingBag(10, 4, mode="sum"), ids(10, 5), like),
    Case(
        "embedding-bag-mean-padding-batch-1",
        lambda: nn.EmbeddingBag(10, 4, mode="mean", padding_idx=0),
        ids(3, 6),
        like,
        batch=1,
    ),
    Case("embedding-bag-max", lambda: nn.EmbeddingBag(10, 4, mode="max"), ids(10, 5), like),
    Case(
        "conv3d-reflect-same",
        lambda: nn.Conv3d(2, 2, 3, padding="same", padding_mode="reflect"),
        randn(2, 4, 3, 5),
        like,
    ),
    Case(
        "conv2d-relu-inplace",
        lambda: conv_head(nn.Conv2d(2, 3, 3), nn.ReLU(inplace=True)),
        randn(2, 6, 6),
        like,
    ),
    Case(
        "conv2d-bn-relu-inplace",
        lambda: conv_head(
            nn.Conv2d(2, 3, 3, padding=1), stats(nn.BatchNorm2d(3)), nn.ReLU(inplace=True)
        ),
        randn(2, 5, 5),
        classes,
        loss="cross_entropy",
    ),
    # Embedding: repeated tokens, padding_idx, index ranks 1-3, two lookups, tied head
    Case(
        "embedding-repeated-tokens",
        lambda: net(nn.Embedding(11, 4), nn.Tanh(), nn.Linear(4, 2)),
        ids(4, 9),
        like,
    ),
    Case(
        "embedding-padding-idx",
        lambda: net(nn.Embedding(10, 3, padding_idx=0), nn.Tanh()),
        ids(3, 8),
        like,
    ),
    Case("embedding-3d-index", lambda: net(nn.Embedding(6, 3), nn.Tanh()), ids(6, 2, 3), like),
    Case("embedding-1d-index", lambda: nn.Embedding(6, 3), ids(6), like),
    Case(
        "embedding-scale-grad-by-freq",
        lambda: net(nn.Embedding(8, 3, scale_grad_by_freq=True, padding_idx=1), nn.Tanh()),
        ids(4, 10),
        like,
    ),
    Case("embedding-called-twice", TwoLookups, lambda b: (*ids(7, 5)(b), *ids(7, 5)(b)), like),
    Case("embedding-tied-head", TiedLM, ids(9, 6), classes, loss="cross_entropy"),
    Case(
        "embedding-tied-head-first",
        lambda: TiedLM(head_first=True),
        ids(9, 6),
        classes,
        loss="cross_entropy",
    ),
    Case(
        "embedding-tied-head-last-padding",
        lambda: TiedLM(last=True),
        ids(9, 6),
        classes,
        loss="cross_entropy",
    ),
    # max_norm renormalises looked-up rows in place, outside autograd: the loop sees the same rows
    Case(
        "embedding-max-norm",
        lambda: net(nn.Embedding(6, 3, max_norm=1.0), nn.Tanh()),
        ids(6, 4),
        like,
    ),
    # Norms, eval mode: affine parameters only, xhat from the module's own functional
    Case(
        "layernorm-seq",
        lambda: net(nn.Linear(5, 6), stats(nn.LayerNorm(6)), nn.Tanh()),
        randn(3, 5),
        like,
    ),
    Case(
        "layernorm-2d-shape",
        lambda: net(stats(nn.LayerNorm((3, 4))), nn.Tanh()),
        randn(2, 3, 4),
        like,
    ),
    # one example, a sequence of 4, a mean far from 0 (the centring's float32 rounding)
    Case(
        "layernorm-2d-shape-batch-1-zero-weight",
        lambda: net(zero_entry(stats(nn.LayerNorm((2, 3)))), nn.Tanh()),
        lambda b: (torch.randn(b, 4, 2, 3) * 3 + 20,),
        like,
        batch=1,
    ),
    Case(
        "layernorm-nobias",
        lambda: net(stats(nn.LayerNorm(6, bias=False)), nn.Tanh()),
        randn(6),
        like,
    ),
    Case(
        "layernorm-no-affine",
        lambda: net(nn.Linear(4, 6), nn.LayerNorm(6, elementwise_affine=False), nn.Tanh()),
        randn(4),
        like,
    ),
    Case("rmsnorm", lambda: net(stats(nn.RMSNorm(6)), nn.Tanh()), randn(3, 6), like),
    Case(
        "rmsnorm-eps", lambda: net(stats(nn.RMSNorm((2, 3), eps=0.5)), nn.Tanh()), randn(2, 3), like
    ),
    Case("groupnorm", lambda: net(stats(nn.GroupNorm(2, 4)), nn.Tanh()), randn(4, 3, 3), like),
    Case("batchnorm1d-flat", lambda: net(stats(nn.BatchNorm1d(5)), nn.Tanh()), randn(5), like),
    Case(
        "batchnorm1d-seq-momentum-none",
        lambda: net(stats(nn.BatchNorm1d(3, momentum=None)), nn.Tanh()),
        randn(3, 4),
        like,
    ),
    Case("batchnorm3d", lambda: net(stats(nn.BatchNorm3d(2)), nn.Tanh()), randn(2, 3, 2, 3), like),
    Case(
        "instancenorm1d",
        lambda: net(stats(nn.InstanceNorm1d(3, affine=True)), nn.Tanh()),
        randn(3, 5),
        like,
    ),
    Case(
        "instancenorm2d-running-stats",
        lambda: net(stats(nn.InstanceNorm2d(2, affine=True, track_running_stats=True)), nn.Tanh()),
        randn(2, 4, 3),
        like,
    ),
    Case(
        "instancenorm3d",
        lambda: net(stats(nn.InstanceNorm3d(2, affine=True)), nn.Tanh()),
        randn(2, 3, 2, 4),
        like,
    ),
    # Library layers, recognised by name or structure: HF Conv1D, HF RMSNorms, timm's LayerNorms,
    # each from transformers and as the hand-written copy in benchmarks/families.py
    Case("hf-conv1d-seq", lambda: net(fam.Conv1D(5, 7), nn.Tanh()), randn(3, 7), like),
    Case("hf-conv1d-nobias-batch-1", lambda: fam.Conv1D(4, 6, bias=False), randn(6), like, batch=1),
    Case("hf-conv1d-long-seq", lambda: fam.Conv1D(2, 3), randn(20, 3), like),
    Case(
        "hf-conv1d-transformers",
        lambda: net(transformers_layer("pytorch_utils.Conv1D", 5, 7)(), nn.Tanh()),
        randn(4, 7),
        like,
    ),
    Case("llama-rmsnorm", lambda: net(stats(fam.LlamaRMSNorm(6)), nn.Tanh()), randn(3, 6), like),
    Case("t5-layernorm-batch-1", lambda: stats(fam.T5LayerNorm(5, 0.1)), randn(5), like, batch=1),
    *(
        Case(
            f"{name.lower()}-transformers",
            lambda path=path: net(stats(transformers_layer(path, 6, 0.01)()), nn.Tanh()),
            randn(4, 6),
            like,
        )
        for name, path in [
            ("LlamaRMSNorm", "models.llama.modeling_llama.LlamaRMSNorm"),
            ("Qwen2RMSNorm", "models.qwen2.modeling_qwen2.Qwen2RMSNorm"),
            ("T5LayerNorm", "models.t5.modeling_t5.T5LayerNorm"),
        ]
    ),
    Case("timm-layernorm-seq", lambda: net(stats(fam.LayerNorm(6)), nn.Tanh()), randn(3, 6), like),
    Case(
        "timm-layernorm-nobias",
        lambda: net(stats(fam.LayerNorm((2, 3), bias=False)), nn.Tanh()),
        randn(4, 2, 3),
        like,
    ),
    Case(
        "timm-layernorm2d",
        lambda: net(nn.Conv2d(2, 4, 1), stats(fam.LayerNorm2d(4)), nn.Tanh()),
        randn(2, 3, 5),
        like,
    ),
    Case(
        "timm-layernorm2d-batch-1", lambda: stats(fam.LayerNorm2d(3)), randn(3, 2, 2), like, batch=1
    ),
    Case(
        "channels-first-layernorm",
        lambda: net(nn.Conv1d(3, 4, 1), stats(ChannelsFirstLayerNorm(4)), nn.Tanh()),
        randn(3, 5),
        like,
    ),
    Case(
        "squeezebert-layernorm-transformers",
        lambda: net(
            nn.Conv1d(3, 4, 1),
            stats(
                transformers_layer(
                    "models.squeezebert.modeling_squeezebert.SqueezeBertLayerNorm", 4
                )()
            ),
            nn.Tanh(),
        ),
        randn(3, 5),
        like,
    ),
    Case(
        "nanogpt-layernorm-nobias",
        lambda: net(stats(fam.NanoGPTLayerNorm(5, bias=False)), nn.Tanh()),
        randn(3, 5),
        like,
    ),
]

FLOAT32 = {
    "linear-seq-gram",
    "conv2d-circular-same-groups",
    "conv2d-bn-relu-inplace",
    "embedding-repeated-tokens",
    "embedding-tied-head",
    "layernorm-seq",
    "layernorm-2d-shape-batch-1-zero-weight",
    "hf-conv1d-seq",
    "llama-rmsnorm",
    "timm-layernorm2d",
}


def by_id(names: set[str]) -> list[Case]:
    return [c for c in CASES if c.id in names]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_norms_match_loop(case: Case) -> None:
    assert_case_matches_loop(case, torch.float64, rtol=1e-5)


@pytest.mark.parametrize("case", by_id(FLOAT32), ids=repr)
def test_norms_match_loop_float32(case: Case) -> None:
    assert_case_matches_loop(case, torch.float32, rtol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_contributions_match_loop(case: Case) -> None:
    """Each parameter's contribution: materialize() is the loop's gradient, norm_sq() its squared
    norm, and inner() its inner product with random references."""
    model, inputs, targets = case.build()
    loss = resolve_loss(case.loss, case.loss_kwargs)
    forward = Forward(output=case.output)
    with Engine(model, loss, forward=forward) as engine:
        _, parts = engine.contributions(inputs, targets)
        _, grads = naive_grads(model, inputs, targets, loss, list(parts), forward)
    assert_fallback(engine, case.fallback)
    for name, part in parts.items():
        expected = grads[name]
        if part is None:  # no call of its module reached the loss
            assert not expected.any(), name
            continue
        refs = torch.randn(3, *part.shape, dtype=torch.float64)
        assert_rel_close(part.materialize(), expected, rtol=1e-5)
        assert_rel_close(part.norm_sq(), expected.flatten(1).pow(2).sum(1), rtol=1e-5)
        assert_rel_close(part.inner(refs), expected.flatten(1) @ refs.flatten(1).T, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "gram"), [("linear-seq-gram", True), ("linear-seq-materialise", False)]
)
def test_outer_norm_sq_takes_the_branch_its_shapes_force(name, gram, monkeypatch) -> None:
    """The Gram route is taken by one call (``ghost.gram_norm_sq``) or by the backward's batched
    norms (``gram_norms``, when the Gram is one block); the materialising route by neither."""
    calls = []
    original, batched = ghost.gram_norm_sq, batched_module.gram_norms
    monkeypatch.setattr(outer, "gram_norm_sq", lambda s, a: calls.append(1) or original(s, a))
    monkeypatch.setattr(
        batched_module, "gram_norms", lambda parts: calls.append(1) or batched(parts)
    )
    assert_case_matches_loop(by_id({name})[0], torch.float64, rtol=1e-5)
    assert bool(calls) == gram


@pytest.mark.parametrize(
    "case", by_id({"linear-seq-gram", "linear-seq-materialise", "conv1d-zeros-stride"}), ids=repr
)
def test_chunked_gram_and_materialise(case: Case, monkeypatch) -> None:
    """A tiny chunk bound splits the Gram into ragged (c, c) blocks and the batch into chunks."""
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 40)
    assert_case_matches_loop(case, torch.float64, rtol=1e-5)


@pytest.mark.parametrize(
    "case", by_id({"linear-seq-gram", "conv1d-zeros-stride", "embedding-tied-head"}), ids=repr
)
def test_inner_products_a_few_references_at_a_time(case: Case, monkeypatch) -> None:
    """With a chunk bound below one reference's product, references are taken one by one."""
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(embedding, "CHUNK_ELEMENTS", 1)
    test_contributions_match_loop(case)


CONV_FORMED = {
    "conv1d-reflect-stride-dilation-groups",
    "conv1d-zeros-stride",
    "conv2d-circular-same-groups",
    "conv2d-zeros-same-even-kernel",
    "conv2d-zeros-stride-dilation-groups-batch-3",
    "conv2d-depthwise-valid-nobias",
    "conv2d-batch-1",
    "conv3d-replicate",
    "conv-transpose1d-output-padding",
    "conv-transpose2d-groups-dilation",
    "conv-transpose3d-no-bias-batch-1",
}


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("case", by_id(CONV_FORMED), ids=repr)
def test_conv_gradients_formed_a_few_examples_at_a_time(case: Case, step: int, monkeypatch) -> None:
    """Past the bound on one temporary, a conv's per-example gradients are formed ``step``
    examples at a time (5 examples in 2: a short last chunk) and every answer is the loop's; a
    batch of one is formed whole."""
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 1)
    formed = []

    def chunked(form, batch, shape, _step):
        formed.append(batch)
        return Formed(form, batch, shape, step)

    monkeypatch.setattr(conv, "Formed", chunked)
    model, inputs, targets = case.build()
    loss = resolve_loss(case.loss, case.loss_kwargs)
    with Engine(model, loss) as engine:
        _, parts = engine.contributions(inputs, targets)
        _, grads = naive_grads(model, inputs, targets, loss, list(parts))
    assert_fallback(engine)
    assert formed == ([case.batch] if case.batch > 1 else [])
    for name, part in parts.items():
        expected = grads[name].flatten(1)  # (B, P)
        refs = torch.randn(3, *part.shape, dtype=torch.float64)
        norm_sq, inner = part.norm_sq_and_inner(refs)
        assert_rel_close(part.materialize().flatten(1), expected, rtol=1e-5)
        assert_rel_close(part.batch_sum().flatten(), expected.sum(0), rtol=1e-5)
        for got in (part.norm_sq(), norm_sq):
            assert_rel_close(got, expected.pow(2).sum(1), rtol=1e-5)
        for got in (part.inner(refs), inner):
            assert_rel_close(got, expected @ refs.flatten(1).T, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 5])
def test_conv_gradients_formed_in_even_chunks_within_its_input_and_output_gradient(
    batch: int, monkeypatch
) -> None:
    """Where a convolution's per-example gradients outweigh its input and output gradient
    (few positions, many channels), they are formed in as few even chunks as keep each
    chunk's forming within what those two hold, the plain backward's own (5 examples: 2, 2
    and 1); a batch of one whole. Every answer is the float64 loop's."""
    steps = []

    def chunked(form, b, shape, step):
        steps.append((b, step))
        return Formed(form, b, shape, step)

    monkeypatch.setattr(conv, "Formed", chunked)
    monkeypatch.setattr(conv, "FORMED_BESIDE", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 7, 3, padding=1), nn.Flatten(), nn.Linear(7 * 35, 1))
    model = model.double()
    x, y = torch.randn(batch, 6, 7, 5).double(), torch.randn(batch, 1).double()
    loss = resolve_loss("mse")
    refs = {n: torch.randn(2, *p.shape).double() for n, p in model.named_parameters()}
    with Engine(model, loss) as engine:
        got = engine.norms((x,), y, refs=refs)
        _, grads = naive_grads(model, (x,), y, loss, list(refs))
    assert_fallback(engine)
    # per example: 210 + 245 input and output gradient, 378 weight: 2 examples a chunk, in 3
    assert steps == ([(5, 2)] if batch == 5 else [])
    for name, per in grads.items():
        assert_rel_close(got.norm_sq[name], per.flatten(1).pow(2).sum(1), 1e-9)
        assert_rel_close(got.inner[name], per.flatten(1) @ refs[name].flatten(1).T, 1e-9)


@pytest.mark.parametrize(
    "module",
    [
        nn.Conv2d(6, 7, 3, padding=1),
        nn.Conv2d(4, 6, 3, stride=(2, 1), padding=(2, 1), dilation=2, groups=2),
        nn.Conv1d(4, 4, 5, padding=2, groups=4, bias=False),
    ],
    ids=["plain", "stride-dilation-groups", "depthwise-1d"],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_conv_gradients_of_a_small_weight_formed_in_one_go(
    module: nn.Module, batch: int, monkeypatch
) -> None:
    """Where the batch's per-example gradients stay within ``FORMED_BESIDE`` beyond the input
    and output gradient, they are formed in one convolution backward, not in chunks, though
    they outweigh those two; norms and inner products are the float64 loop's."""
    formed = []
    monkeypatch.setattr(conv, "Formed", lambda *a: formed.append(a) or Formed(*a))
    torch.manual_seed(0)
    x = torch.randn(batch, module.in_channels, *[7, 5][: len(module.kernel_size)])
    model = nn.Sequential(module, nn.Tanh(), nn.Flatten(), nn.LazyLinear(1)).double()
    x, y = x.double(), torch.randn(batch, 1).double()
    model(x)
    loss = resolve_loss("mse")
    refs = {n: torch.randn(2, *p.shape).double() for n, p in model.named_parameters()}
    with Engine(model, loss) as engine:
        got = engine.norms((x,), y, refs=refs)
        _, grads = naive_grads(model, (x,), y, loss, list(refs))
    assert formed == []
    for name, per in grads.items():
        assert_rel_close(got.norm_sq[name], per.flatten(1).pow(2).sum(1), 1e-9)
        assert_rel_close(got.inner[name], per.flatten(1) @ refs[name].flatten(1).T, 1e-9)


def test_conv_pads_without_a_copy_of_its_input(monkeypatch) -> None:
    """Zero padding even on both sides is the convolution's own: no padded copy of the input."""
    padded, pad = [], F.pad
    monkeypatch.setattr(F, "pad", lambda *a, **k: padded.append(1) or pad(*a, **k))
    for module in (nn.Conv2d(2, 3, 3, padding=(2, 1)), nn.Conv2d(2, 3, 4, padding="same")):
        x = torch.randn(2, 2, 6, 5)
        grads = conv.per_example_weight_grads(module, x, torch.randn_like(module(x)))
        assert grads.shape == (2, *module.weight.shape)
    assert padded == [1]  # only "same" with an even kernel pads one side more than the other


def test_tied_head_cross_terms_in_chunks(monkeypatch) -> None:
    """The embedding/head cross term, its head positions taken a few at a time."""
    monkeypatch.setattr(embedding, "CHUNK_ELEMENTS", 40)
    assert_case_matches_loop(by_id({"embedding-tied-head"})[0], torch.float64, rtol=1e-5)


EMBEDDINGS = [c for c in CASES if c.id.startswith("embedding-") and "bag" not in c.id]


@pytest.mark.parametrize("case", EMBEDDINGS, ids=repr)
def test_embedding_norms_of_long_sequences_by_sorted_rows(case: Case, monkeypatch) -> None:
    """Past ``GRAM_POSITIONS`` an example's rows are summed by a sort of its ids, not a Gram of
    its positions: the loop's norms either way."""
    monkeypatch.setattr(embedding, "GRAM_POSITIONS", 0)
    assert_case_matches_loop(case, torch.float64, rtol=1e-5)


@pytest.mark.parametrize("padding", [None, 1])
def test_embedding_scaled_by_frequency_is_each_examples_own(padding: int | None) -> None:
    """``scale_grad_by_freq`` divides a row's gradient by its count in the example alone (the
    loop's), not in the batch (autograd's): the self-check compares batch sums alone there,
    so the rule is compared with the loop here."""
    torch.manual_seed(0)
    module = nn.Embedding(8, 3, scale_grad_by_freq=True, padding_idx=padding).double()
    ids = torch.randint(0, 4, (3, 10))
    g = torch.randn(3, 10, 3, dtype=torch.float64)
    part = find_rule(module).fn(module, (ids,), g)["weight"]
    assert_rel_close(part.materialize(), alone(module, ids, g)["weight"], 1e-12)


@pytest.mark.parametrize("padding", [None, 1])
def test_embedding_scaled_by_frequency_sums_as_autograds_batch(padding: int | None) -> None:
    """The examples' gradients, each row weighed by its count in the example over its count in
    the batch, add up to autograd's batch gradient (the self-check's sum); two lookups' each
    by its own counts."""
    torch.manual_seed(0)
    module = nn.Embedding(8, 3, scale_grad_by_freq=True, padding_idx=padding).double()
    ids = torch.randint(0, 4, (3, 10))
    g = torch.randn(3, 10, 3, dtype=torch.float64)
    part = find_rule(module).fn(module, (ids,), g)["weight"]
    (batch,) = torch.autograd.grad(module(ids), module.weight, g)
    assert_rel_close(part.batch_sum(), batch, 1e-12)
    assert_rel_close(part.merge(part.examples(0, 3)).batch_sum(), 2 * batch, 1e-12)


def test_batchnorm_without_running_stats_is_refused() -> None:
    model = net(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
    with pytest.raises(ModelError, match="track_running_stats=False"):
        gradscope.per_example_norms(model, torch.randn(5, 3), torch.randn(5, 4), "mse")


def test_conv_on_an_unbatched_input_is_refused() -> None:
    """A Conv2d fed (B, H, W) takes the batch for channels: no example has its own gradient."""
    model = nn.Conv2d(4, 4, 1)
    with pytest.raises(ModelError, match="unbatched"):
        gradscope.per_example_norms(model, torch.randn(4, 3, 3), torch.randn(4, 3, 3), "mse")


@settings(max_examples=60, deadline=None)
@given(
    dims=st.integers(1, 3),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 3),
    dilation=st.integers(1, 2),
    padding=st.sampled_from([0, 1, 2, "same", "valid"]),
    groups=st.sampled_from([1, 2]),
    mode=st.sampled_from(["zeros", "reflect", "replicate", "circular"]),
    size=st.integers(5, 7),
    batch=st.integers(1, 2),
)
def test_unfold_reproduces_the_conv_forward(
    dims, kernel, stride, dilation, padding, groups, mode, size, batch
) -> None:
    """patches @ weight^T is the module's own output, bias aside, for any conv configuration."""
    if padding == "same":
        stride = 1  # PyTorch refuses "same" with a stride
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]
    module = conv(2, 4, kernel, stride, padding, dilation, groups, False, mode).double()
    x = torch.randn(batch, 2, *[size + d for d in range(dims)], dtype=torch.float64)
    expected = module(x)  # (B, out, *L)
    a = unfold(module, x)  # (B, G, T, in/G * prod(k))
    w = module.weight.reshape(groups, 4 // groups, -1)  # (G, out/G, in/G * prod(k))
    got = torch.einsum("bgti,goi->bgot", a, w).reshape(expected.shape)  # (B, out, *L)
    assert_rel_close(got, expected, rtol=1e-12)


def test_registry_lists_every_layer_type() -> None:
    """Fails when a rule module is not imported by gradscope.rules, or a type is added unlisted."""
    expected = {
        nn.Linear: "linear",
        nn.Conv1d: "conv",
        nn.Conv2d: "conv",
        nn.Conv3d: "conv",
        nn.ConvTranspose1d: "conv_transpose",
        nn.ConvTranspose2d: "conv_transpose",
        nn.ConvTranspose3d: "conv_transpose",
        nn.Embedding: "embedding",
        nn.EmbeddingBag: "embedding_bag",
        nn.LayerNorm: "layer_norm",
        nn.RMSNorm: "rms_norm",
        nn.GroupNorm: "group_norm",
        nn.BatchNorm1d: "batch_norm",
        nn.BatchNorm2d: "batch_norm",
        nn.BatchNorm3d: "batch_norm",
        nn.InstanceNorm1d: "instance_norm",
        nn.InstanceNorm2d: "instance_norm",
        nn.InstanceNorm3d: "instance_norm",
        nn.RNN: "recurrent",
        nn.GRU: "recurrent",
        nn.LSTM: "recurrent",
    }
    assert {t: r.name for t, r in RULES.items()} == expected
    assert {n: r.name for n, r in NAMED.items()} == {
        "transformers.pytorch_utils.Conv1D": "hf_conv1d"
    }
    assert [r.name for _, r in MATCHERS] == ["attention", "hf_conv1d", "library_norm"]


def test_subclass_overriding_forward_has_no_rule() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    assert find_rule(SubLinear(2, 2)).name == "linear"
    assert find_rule(Scaled(2, 2)) is None
