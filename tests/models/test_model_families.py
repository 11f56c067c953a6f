"""Real model families end to end against the float64 loop, and which parameters the rules serve.

Hugging Face GPT-2, BERT (padded batch) and LLaMA (grouped-query attention) from tiny configs,
random init; nanoGPT and a timm-style ViT as written in benchmarks/families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import families as fam
import pytest
import torch
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, Plan
from gradscope.losses import resolve_loss

VOCAB, T = 97, 12


@dataclass
class Family:
    id: str
    model: Callable[[], nn.Module]
    batch: Callable[[], tuple[tuple[Tensor, ...], Tensor]]  # (inputs, targets), seeded
    rules: set[str]  # library rules the model must be served by

    def __repr__(self) -> str:
        return self.id


def hf(builder: Callable[..., nn.Module], **kw: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        pytest.importorskip("transformers")
        return builder(**kw)

    return build


def next_tokens(b: int = 3) -> tuple[tuple[Tensor, ...], Tensor]:
    """(ids,), ids shifted by one: the model's logits at 0..T-2 against tokens 1..T-1."""
    ids = torch.randint(0, VOCAB, (b, T))
    return (ids,), ids[:, 1:]


def padded(b: int = 4) -> tuple[tuple[Tensor, ...], Tensor]:
    """(ids, mask) with padding after each example's length (token 0), and 3-way labels."""
    mask = fam.padding_mask(b, T)
    return (torch.randint(1, VOCAB, (b, T)) * mask, mask), torch.randint(0, 3, (b,))


def nanogpt_batch(b: int = 3) -> tuple[tuple[Tensor, ...], Tensor]:
    ids = torch.randint(0, VOCAB, (b, T + 1))
    return (ids[:, :-1],), ids[:, 1:]


def images(b: int = 3) -> tuple[tuple[Tensor, ...], Tensor]:
    return (torch.randn(b, 3, 8, 8),), torch.randint(0, 5, (b,))


FAMILIES = [
    Family(
        "hf-gpt2",
        hf(fam.hf_gpt2, vocab=VOCAB, d=32, layers=2, heads=4, seq=16),
        next_tokens,
        {"hf_conv1d"},
    ),
    Family(
        "hf-bert-padded",
        hf(fam.hf_bert, vocab=VOCAB, d=32, layers=2, heads=4, seq=16, attn_implementation="eager"),
        padded,
        set(),
    ),
    Family(
        "hf-llama-gqa",
        hf(fam.hf_llama, vocab=VOCAB, d=32, layers=2, heads=4, kv_heads=2, seq=16),
        next_tokens,
        {"library_norm"},
    ),
    Family(
        "nanogpt",
        lambda: fam.NanoGPT(VOCAB, block_size=16, d=32, heads=4, layers=2),
        nanogpt_batch,
        {"library_norm"},
    ),
    Family(
        "vit",
        lambda: fam.ViT(img=8, patch=4, d=32, layers=2, heads=4, classes=5, init_values=0.1),
        images,
        set(),
    ),
]


def build(family: Family) -> tuple[nn.Module, tuple[Tensor, ...], Tensor]:
    """The family's model in float64, eval mode, and a seeded batch."""
    torch.manual_seed(0)
    model = family.model().double().eval()
    inputs, targets = family.batch()
    return model, tuple(t.double() if t.is_floating_point() else t for t in inputs), targets


def served(model: nn.Module, inputs: tuple[Tensor, ...], targets: Tensor) -> Plan:
    """The plan as one pass leaves it: what the engine finally served each parameter with."""
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        engine.norms(inputs, targets)
    return engine.plan


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_norms_match_loop(family: Family) -> None:
    model, inputs, targets = build(family)
    _, expected = reference_norms(model, inputs, targets, "cross_entropy")
    actual = gradscope.per_example_norms(model, inputs, targets, "cross_entropy")
    assert_rel_close(actual, expected, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_every_parameter_is_on_a_rule(family: Family) -> None:
    """HF Conv1D and the norms of model libraries among them: nothing is left to the fallback
    (position tables shared by the batch, cls_token, pos_embed and LayerScale gammas included)."""
    plan = served(*build(family))
    assert_fallback(plan)
    assert family.rules <= {rule for p in plan.by_rule for rule in p.rule.split("+")}
