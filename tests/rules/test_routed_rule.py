"""``Routed``: the per-example gradients of a fused expert weight read by ``grouped_mm`` on rows
of any example and expert, against each row's outer product added up by hand in float64."""

from __future__ import annotations

import pytest
import torch

from gradscope.rules.routed import Routed, routed_norms

B, E, IN, OUT, S = 3, 4, 5, 6, 20


def _case(transposed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(S, IN, generator=g, dtype=torch.float64)
    s = torch.randn(S, OUT, generator=g, dtype=torch.float64)
    own = torch.randint(0, B, (S,), generator=g)
    offs = torch.tensor([5, 5, 12, 18], dtype=torch.int32)  # expert 1 runs none; 2 rows past
    shape = torch.Size((E, IN, OUT) if transposed else (E, OUT, IN))
    expected = torch.zeros(B, *shape, dtype=torch.float64)
    expert = torch.searchsorted(offs, torch.arange(S, dtype=torch.int32), right=True)
    for r in range(S):
        if expert[r] < E:
            outer = torch.outer(a[r], s[r]) if transposed else torch.outer(s[r], a[r])
            expected[own[r], expert[r]] += outer
    return Routed.of(a, s, own, offs, shape, B, transposed), expected


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_routed_matches_rows_added_by_hand(transposed: bool):
    part, expected = _case(transposed)
    refs = torch.randn(2, *expected.shape[1:], dtype=torch.float64)
    flat = expected.flatten(1)
    torch.testing.assert_close(part.materialize(), expected)
    torch.testing.assert_close(part.norm_sq(), flat.square().sum(1))
    torch.testing.assert_close(part.inner(refs), flat @ refs.flatten(1).T)
    torch.testing.assert_close(part.merge(part).norm_sq(), 4 * flat.square().sum(1))
    some = part.examples(1, 3)
    torch.testing.assert_close(some.norm_sq(), flat[1:3].square().sum(1))
    torch.testing.assert_close(some.inner(refs), flat[1:3] @ refs.flatten(1).T)


def test_routed_norms_of_several_reads_are_each_reads_own():
    """Three reads of one shape (a backward's layers) answered by one batched product: each
    read's norms as the rows added by hand give them, whichever rows and experts it has."""
    cases = [_case(False, seed) for seed in range(3)]
    norms = routed_norms([part for part, _ in cases])
    assert norms.shape == (3, B)
    for k, (_, expected) in enumerate(cases):
        torch.testing.assert_close(norms[k], expected.flatten(1).square().sum(1))
