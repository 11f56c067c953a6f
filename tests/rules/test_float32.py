"""Float32 contributions over long rows as accurate as float32 itself: a norm or inner product of
hundreds of thousands of terms within 1e-6 of float64, as the loop's own gradients are. The
CPU's long float32 reductions (``vector_norm``, a matrix product's inner dimension) lose up to
2e-4 there; ``rules.base.BLOCK`` keeps each sum short. Positive terms, where nothing cancels,
so every digit lost is the summation's."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close

from gradscope.rules import Dense, Outer
from gradscope.rules.embedding import Rows

RTOL = 1e-6


def _positive(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("p", [3, 2**21, 2**21 + 5])
def test_dense_norm_and_inner_over_long_rows(p: int):
    grads, refs = _positive(2, p), _positive(3, p, seed=1)
    part = Dense(grads)
    assert_rel_close(part.norm_sq(), grads.double().pow(2).sum(1), RTOL)
    assert_rel_close(part.inner(refs), grads.double() @ refs.double().T, RTOL)


def test_outer_norm_formed_and_inner_over_many_positions():
    # 2 examples, 512 positions, 512 outputs, 256 inputs: G formed (no Gram), 131k entries
    s, a = _positive(2, 1, 512, 512), _positive(2, 1, 512, 256, seed=1)
    refs = _positive(1, 512, 256, seed=2)
    part = Outer(s, a, torch.Size((512, 256)))
    g = s.double()[:, 0].mT @ a.double()[:, 0]  # (B, O, I)
    assert_rel_close(part.norm_sq(), g.pow(2).sum((1, 2)), RTOL)
    assert_rel_close(part.inner(refs), (g * refs.double()).sum((1, 2))[:, None], RTOL)


def test_embedding_inner_over_many_positions():
    # 2 examples of 1024 positions into a table of 64 rows of 512: 524k terms each
    ids = torch.randint(0, 64, (2, 1024), generator=torch.Generator().manual_seed(3))
    s, refs = _positive(2, 1024, 512), _positive(2, 64, 512, seed=1)
    want = (refs.double()[:, ids] * s.double()).sum((2, 3)).T  # (B, K)
    assert_rel_close(Rows(ids, s, 64).inner(refs), want, RTOL)
