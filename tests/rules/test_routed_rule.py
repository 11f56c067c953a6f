"""``Routed``: the per-example gradients of a fused expert weight read by ``grouped_mm`` on rows
of any example and expert, against each row's outer product added up by hand in float64."""

from __future__ import annotations

import pytest
import torch
from peaks import NewBytes

from gradscope.rules import routed
from gradscope.rules.routed import Routed, routed_inners, routed_norms

B, E, IN, OUT, S = 3, 4, 5, 6, 20


def _close32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A float32 answer against float64's, at float32's rounding over a few sums: an error
    against the largest entry, as the sums' rounding is, not against each entry."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * scale)


def _case(transposed: bool, seed: int = 0, dtype: torch.dtype = torch.float64, dims=(IN, OUT)):
    """The rows' Routed in ``dtype`` and, in float64, each example's gradient by hand."""
    g = torch.Generator().manual_seed(seed)
    n_in, n_out = dims
    a = torch.randn(S, n_in, generator=g, dtype=torch.float64)
    s = torch.randn(S, n_out, generator=g, dtype=torch.float64)
    own = torch.randint(0, B, (S,), generator=g)
    offs = torch.tensor([5, 5, 12, 18], dtype=torch.int32)  # expert 1 runs none; 2 rows past
    shape = torch.Size((E, n_in, n_out) if transposed else (E, n_out, n_in))
    expected = torch.zeros(B, *shape, dtype=torch.float64)
    expert = torch.searchsorted(offs, torch.arange(S, dtype=torch.int32), right=True)
    for r in range(S):
        if expert[r] < E:
            outer = torch.outer(a[r], s[r]) if transposed else torch.outer(s[r], a[r])
            expected[own[r], expert[r]] += outer
    return Routed.of(a.to(dtype), s.to(dtype), own, offs, shape, B, transposed), expected


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_routed_matches_rows_added_by_hand(transposed: bool):
    part, expected = _case(transposed)
    refs = torch.randn(
        2, *expected.shape[1:], generator=torch.Generator().manual_seed(101), dtype=torch.float64
    )
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


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_rows_by_their_own_experts_matrix_in_float32(transposed: bool):
    """The CPU's float32 route: each row by its own expert's matrix in one ``grouped_mm``, the
    rows past the last group (no expert) included, for one read and for several reads at once
    (each with its own references, stacked or a list), against the rows added by hand in
    float64."""
    cases = [_case(transposed, seed, torch.float32, (8, 12)) for seed in range(3)]
    assert all(part.sorted_route for part, _ in cases)
    refs = torch.randn(
        3,
        2,
        *cases[0][1].shape[1:],
        generator=torch.Generator().manual_seed(102),
        dtype=torch.float64,
    )
    together = routed_inners([part for part, _ in cases], refs.float())
    assert together.shape == (3, B, 2)
    listed = routed_inners([part for part, _ in cases], list(refs.float()))  # as Batched gives
    torch.testing.assert_close(listed, together, rtol=0, atol=0)
    for k, (part, expected) in enumerate(cases):
        exact = expected.flatten(1) @ refs[k].flatten(1).T
        _close32(part.inner(refs[k].float()), exact)
        _close32(together[k], exact)
        _close32(part.merge(part).inner(refs[k].float()), 2 * exact)
    assert not _case(False, 0, torch.float32)[0].sorted_route  # rows of 5 floats: 20 bytes


def test_experts_bias_rows_by_their_own_experts_bias():
    """A bias picked by expert (``x + b[e]``: inputs of ones, width 1) on the float32 route."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(S, OUT + 2, generator=g, dtype=torch.float64)
    own = torch.randint(0, B, (S,), generator=g)
    expert = torch.tensor(2).expand(S)
    part = Routed(torch.ones(S, 1), s.float(), own, expert, torch.Size((E, OUT + 2)), B, True)
    expected = torch.zeros(B, E, OUT + 2, dtype=torch.float64).index_put_(
        (own, expert), s, accumulate=True
    )
    refs = torch.randn(
        2, E, OUT + 2, generator=torch.Generator().manual_seed(103), dtype=torch.float64
    )
    assert part.sorted_route
    _close32(part.inner(refs.float()), expected.flatten(1) @ refs.flatten(1).T)


def test_rows_by_their_own_experts_matrix_a_few_rows_at_a_time(monkeypatch: pytest.MonkeyPatch):
    """Rows in chunks (many references on long sequences): each chunk's groups cut to its
    rows, the answers those of the rows added by hand."""
    monkeypatch.setattr(routed, "CHUNK_ELEMENTS", 50)  # 2 rows of 2 refs of width 12 each
    cases = [_case(False, seed, torch.float32, (8, 12)) for seed in range(2)]
    refs = torch.randn(
        2,
        2,
        *cases[0][1].shape[1:],
        generator=torch.Generator().manual_seed(104),
        dtype=torch.float64,
    )
    together = routed_inners([part for part, _ in cases], refs.float())
    for k, (_, expected) in enumerate(cases):
        _close32(together[k], expected.flatten(1) @ refs[k].flatten(1).T)


def test_many_references_are_copied_one_at_a_time():
    """Six references, each of three reads, as ``Batched`` lists them: each reference's
    (3 reads x E experts) block, 72 KiB, copied in turn and let go before the next; all six
    held at once were 432 KiB (the rows themselves: some 54 KiB)."""
    cases = [_case(False, seed, torch.float32, (32, 48)) for seed in range(3)]
    parts = [part for part, _ in cases]
    shape = cases[0][1].shape[1:]
    refs = list(torch.randn(3, 6, *shape, generator=torch.Generator().manual_seed(105)))
    block = 3 * shape.numel() * 4
    with NewBytes([*refs, *(t for p in parts for t in (p.a, p.s, p.own, p.key))]) as made:
        together = routed_inners(parts, refs)
    assert made.peak < 2 * block
    for k, (_, expected) in enumerate(cases):
        _close32(together[k], expected.flatten(1) @ refs[k].double().flatten(1).T)


def _top2(batch: int, tokens: int, seed: int) -> tuple[Routed, torch.Tensor]:
    """Rows as a top-2 router lays them out for ``grouped_mm`` (each token twice, by two
    experts, sorted by expert: one example's rows apart, among the others'), expert 0 given
    no token of example 0 and expert 3 none at all, and float64's squared norms by hand."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch * tokens, E, generator=g, dtype=torch.float64)
    scores[:tokens, 0] = -1  # example 0's tokens: never expert 0
    scores[:, 3] = -2
    expert_ids, perm = torch.sort(scores.topk(2).indices.flatten(), stable=True)
    own = perm // 2 // tokens  # (S,) each row's example
    a = torch.randn(len(perm), IN, generator=g, dtype=torch.float64)
    s = torch.randn(len(perm), OUT, generator=g, dtype=torch.float64)
    offs = torch.bincount(expert_ids, minlength=E).cumsum(0).to(torch.int32)
    expected = torch.zeros(batch, E, OUT, IN, dtype=torch.float64)
    for r in range(len(perm)):
        expected[own[r], expert_ids[r]] += torch.outer(s[r], a[r])
    part = Routed.of(a, s, own, offs, torch.Size((E, OUT, IN)), batch)
    return part, expected.flatten(1).square().sum(1)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("chunk", [None, 20], ids=["one Gram", "in chunks"])
def test_norms_pair_only_one_examples_rows_of_one_expert(
    batch: int, chunk: int | None, monkeypatch: pytest.MonkeyPatch
):
    """Top-2 routing, uneven (an expert given no token of some example, one given none): each
    example's squared norm has every pair of its rows run by one expert, wherever the rows
    lie, and no pair across examples or experts, in one Gram, in chunks of rows, and batched
    with another read."""
    if chunk is not None:
        monkeypatch.setattr(
            routed, "CHUNK_ELEMENTS", chunk
        )  # 2 rows (batch 1), 1 row (batch 3) at a time
    part, expected = _top2(batch, 5, seed=batch)
    other, expected_other = _top2(batch, 5, seed=batch + 10)
    assert part.one_gram == (chunk is None)
    torch.testing.assert_close(part.norm_sq(), expected)
    if chunk is None:
        together = routed_norms([part, other])
        torch.testing.assert_close(together, torch.stack([expected, expected_other]))
