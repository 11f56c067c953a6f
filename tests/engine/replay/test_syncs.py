"""A steady pass adds no host-device synchronisation to a dense model: on the op graphs of Hugging
Face GPT-2, LLaMA and BERT, a replayed batch reads back to the host what one plain forward and
backward with the same loss reads, and nothing more. Counted as calls of the tensor methods and
functions that wait for the device (``bool``, ``item``, ``tolist``, ``equal``, ``unique``, ...);
``benchmarks/cuda_check.py`` counts them on a GPU itself."""

from __future__ import annotations

import pytest
import torch
from syncs import counted

from gradscope.engine import Engine
from gradscope.losses import resolve_loss

transformers = pytest.importorskip("transformers")
import families  # noqa: E402 - after the skip: its builders import transformers


def _model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        return families.hf_gpt2(vocab=64, d=16, layers=2, heads=2, seq=8)
    if family == "llama":
        return families.hf_llama(vocab=64, d=16, layers=2, heads=2, kv_heads=1, seq=8)
    return families.hf_bert(vocab=64, d=16, layers=2, heads=2, seq=8)


def _batch(family: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 8), generator=g)
    if family == "bert":
        return (ids,), torch.randint(0, 3, (3,), generator=g)
    return (ids,), ids[:, 1:].contiguous()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_a_replayed_pass_syncs_no_more_than_a_plain_step(family: str):
    model = _model(family).eval()
    loss = resolve_loss("cross_entropy")
    params = [p for p in model.parameters() if p.requires_grad]
    engine = Engine(model, loss)
    with engine:
        for seed in range(2):  # the analysis, then a first replay
            engine.norms(*_batch(family, seed))
        inputs, targets = _batch(family, 2)
        with counted() as plain:
            torch.autograd.grad(loss(model(*inputs), targets).sum(), params)
        with counted() as ours:
            engine.norms(inputs, targets)
        assert engine.record.at(inputs, targets).replays == 2  # the counted pass replayed
    assert sorted(ours) == sorted(plain), (ours, plain)
