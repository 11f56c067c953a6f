"""The benchmark's all-layer hooks (benchmarks/layer_hooks.py), the yardstick for an exact pass,
give every example's exact gradient norm on the tiny and host workloads' model families, in
float64 against one backward per example."""

from __future__ import annotations

import copy

import families
import methods
import pytest
import torch
import workloads
from torch import nn

CPU = torch.device("cpu")


def _hf(build, **config):
    pytest.importorskip("transformers")
    return lambda: workloads._host(build, **config)


PROBLEMS = {
    # T1: MultiheadAttention read through F.linear, LayerNorm, two embeddings
    "classifier": lambda: workloads._classifier(vocab=40, seq=5, d=8, heads=2, batch=3),
    # T2: the table tied to the output layer, a causal mask, pre-norm
    "tied lm": lambda: workloads._lm(vocab=40, seq=5, d=8, heads=2, batch=3),
    "mlp": lambda: workloads._mlp([4, 6, 1], 5),
    "cnn": lambda: workloads._images(workloads.SmallCNN, (3, 16, 16), 3),
    # H1-H4: Conv1D and a tied table read at shared positions, RMSNorm, BERT's padding row and
    # token types, a router and grouped experts
    "gpt2": _hf(families.hf_gpt2, layers=2, heads=2),
    "llama": _hf(families.hf_llama, layers=2, heads=2, kv_heads=1),
    "bert": lambda: _bert(),
}


def _bert() -> workloads.Problem:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = families.hf_bert(vocab=40, d=16, layers=2, heads=2, seq=6)
    ids = torch.randint(0, 40, (3, 6))
    ids[0, -2:] = model.model.config.pad_token_id  # rows of the padding index
    return workloads._problem(
        model, lambda n: ((ids[:n],), torch.randint(0, 3, (n,))), 3, "cross_entropy"
    )


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_every_layer_exact_against_the_loop(name):
    pb = PROBLEMS[name]().to(CPU, torch.float64)
    got = methods.all_layer_hooks(pb)()
    want = methods.loop_norms(pb)()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def test_grouped_experts_exact_against_the_loop():
    """grouped_mm has no float64: the hooks in float32, the loop in float64 on a copy whose
    experts run transformers' eager loop over experts."""
    pb = _hf(families.hf_mixtral, layers=2, heads=2, experts=4)()
    got = methods.all_layer_hooks(pb)()
    pb64 = pb.to(CPU, torch.float64)
    pb64.model = copy.deepcopy(pb64.model)
    pb64.model.model.config._experts_implementation = "eager"
    want = methods.loop_norms(pb64)()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_a_parameter_no_rule_serves_is_refused():
    pb = workloads._mlp([4, 6, 1], 5)
    pb.model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match="no rule for scale"):
        methods.all_layer_hooks(pb)
