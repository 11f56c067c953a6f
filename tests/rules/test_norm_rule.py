"""The LayerNorm rule called directly against the float64 per-example loop: its xhat from the
input's statistics, on the shapes an end-to-end case may not reach (the engine's self-check would
send a wrong rule to the fallback there, and the norms would still match)."""

from __future__ import annotations

import pytest
import torch
from oracle import alone, assert_rel_close
from torch import nn

from gradscope.rules import find_rule


def zero_entry(norm: nn.LayerNorm) -> nn.LayerNorm:
    with torch.no_grad():
        norm.weight.normal_()
        norm.weight.view(-1)[1] = 0.0  # that entry's output is the bias alone
        if norm.bias is not None:
            norm.bias.normal_()
    return norm


CASES = [
    # one example, a sequence of 4, a normalized shape of 2 dims, a mean far from 0
    (lambda: zero_entry(nn.LayerNorm((2, 3))), (1, 4, 2, 3), 20.0),
    # no sequence, no bias
    (lambda: zero_entry(nn.LayerNorm(6, bias=False)), (3, 6), 0.0),
    # a large eps, two dims of positions
    (lambda: zero_entry(nn.LayerNorm(5, eps=0.5)), (2, 3, 2, 5), -3.0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("build", "shape", "offset"), CASES)
def test_layer_norm_rule_matches_the_loop(build, shape, offset, dtype) -> None:
    torch.manual_seed(0)
    module = build().to(dtype)
    x = torch.randn(shape, dtype=dtype) * 3 + offset
    g = torch.randn(shape, dtype=dtype)
    parts = find_rule(module).fn(module, (x,), g)
    expected = alone(module, x, g)
    assert set(parts) == set(expected)
    for name, part in parts.items():
        assert_rel_close(
            part.materialize(), expected[name], 1e-12 if dtype == torch.float64 else 1e-5
        )


def test_layer_norm_without_affine_has_no_parameters() -> None:
    module = nn.LayerNorm((2, 3), elementwise_affine=False)
    x = torch.randn(1, 4, 2, 3)
    assert find_rule(module).fn(module, (x,), torch.randn_like(x)) == {}
