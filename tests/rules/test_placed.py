"""Blocks of placed contributions, the experts of a fused 3-D weight read by one pass: a
training step's squared norms and batch sum (``norm_sq_and_sum``), each expert's formed from
its examples' own rows and written where it sits (transposed, scaled), against a loop."""

from __future__ import annotations

import pytest
import torch

from gradscope.rules import Outer
from gradscope.rules.placed import Blocks, Place, Placed

E, OUT, IN = 3, 4, 5


# expert 1 runs no row; expert 2's rows, one per example, take no Gram (its sum is its own)
@pytest.mark.parametrize(("transposed", "scale"), [(False, 1.0), (True, 0.5)])
@pytest.mark.parametrize("last", [[1, 5, 2], [1, 1, 0]])
def test_experts_norms_and_sum_are_the_loops(transposed, scale, last):
    torch.manual_seed(6)
    shape = torch.Size((E, IN, OUT) if transposed else (E, OUT, IN))
    rows = {0: [4, 0, 6], 2: last}
    grads = torch.zeros(3, *shape, dtype=torch.float64)  # each example's, by a loop
    blocks = []
    for e, lengths in rows.items():
        t = max(lengths)
        s, a = torch.randn(3, 1, t, OUT).double(), torch.randn(3, 1, t, IN).double()
        for b, n in enumerate(lengths):
            s[b, :, n:], a[b, :, n:] = 0, 0
            g = sum((torch.outer(s[b, 0, p], a[b, 0, p]) for p in range(n)), torch.zeros(OUT, IN))
            grads[b, e] = scale * (g.T if transposed else g)
        part = Outer(s, a, torch.Size((OUT, IN)), lengths)
        blocks.append(Placed(part, shape, Place((e,), transposed, scale)))
    merged = blocks[0].merge(blocks[1])
    assert isinstance(merged, Blocks) and merged.forms(train=True)
    assert blocks[1].forms(train=True) == (last != [1, 1, 0])
    norms, total = merged.norm_sq_and_sum()
    torch.testing.assert_close(norms, grads.flatten(1).square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, grads.sum(0), rtol=1e-12, atol=1e-12)
