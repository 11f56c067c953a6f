"""Outer with ``lengths``: examples padded to the longest answered in groups of similar length,
each cut to its group's longest, with the same answers as the whole padded product; its inner
products, one call's and several calls' stacked, against the gradients formed; and a training
step's norms and batch sum formed a chunk at a time in one buffer."""

from __future__ import annotations

import pytest
import torch
from peaks import NewBytes

from gradscope.rules import Outer, formed, outer
from gradscope.rules.ghost import ghost_inner


def padded(lengths: list[int], g: int, t: int, o: int, i: int) -> tuple[torch.Tensor, ...]:
    """(B, G, T, O) and (B, G, T, I) float64 factors, zero from each example's length on."""
    s, a = torch.randn(len(lengths), g, t, o).double(), torch.randn(len(lengths), g, t, i).double()
    for b, n in enumerate(lengths):
        s[b, :, n:], a[b, :, n:] = 0, 0
    return s, a


# uneven (an expert's rows of each example), with an example that has none, batch 1, a
# group route that forms G (long rows, small matrix) and one that takes the Gram (short rows)
CASES = [
    ([7, 2, 0, 11, 10, 1], 1, 11, 3, 4),
    ([5], 1, 9, 6, 5),
    ([40, 3, 38, 2], 2, 40, 3, 2),
    ([3, 1, 2, 3], 1, 3, 30, 40),
]


@pytest.mark.parametrize(("lengths", "g", "t", "o", "i"), CASES)
def test_lengths_give_the_padded_answers(lengths, g, t, o, i):
    torch.manual_seed(0)
    s, a = padded(lengths, g, t, o, i)
    shape = torch.Size((g * o, i))
    whole, cut = Outer(s, a, shape), Outer(s, a, shape, lengths)
    refs = torch.randn(3, *shape).double()
    grads = torch.einsum("bgto,bgti->bgoi", s, a).reshape(len(lengths), *shape)
    torch.testing.assert_close(cut.materialize(), grads)
    torch.testing.assert_close(cut.norm_sq(), grads.flatten(1).square().sum(1))
    torch.testing.assert_close(cut.norm_sq(), whole.norm_sq())
    torch.testing.assert_close(cut.inner(refs), whole.inner(refs))
    both, whole_both = cut.norm_sq_and_inner(refs), whole.norm_sq_and_inner(refs)
    for mine, theirs in zip(both, whole_both, strict=True):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(cut.batch_sum(), grads.sum(0))


def test_groups_are_cut_to_their_longest():
    lengths = [7, 2, 0, 11, 10, 1]
    s, a = padded(lengths, 1, 11, 3, 4)
    groups = Outer(s, a, torch.Size((3, 4)), lengths)._groups()
    got = [(index.tolist(), part.dims[2]) for index, part in groups]
    assert got == [([3, 4], 11), ([0], 7), ([1], 2), ([5], 1)]  # example 2 has no rows: in none


def test_full_lengths_are_no_lengths():
    s, a = padded([4, 4], 1, 4, 3, 2)
    assert Outer(s, a, torch.Size((3, 2)), [4, 4])._groups() is None


def test_merged_positions_follow_each_other():
    """A module called twice on routed rows: the second call's rows come after the first's
    padded positions, and an example without rows there keeps its first length."""
    torch.manual_seed(1)
    first, second = padded([3, 1, 0], 1, 3, 2, 5), padded([0, 2, 2], 1, 2, 2, 5)
    shape = torch.Size((2, 5))
    merged = Outer(*first, shape, [3, 1, 0]).merge(Outer(*second, shape, [0, 2, 2]))
    assert merged.lengths == (3, 5, 5)
    whole = Outer(*first, shape).merge(Outer(*second, shape))
    torch.testing.assert_close(merged.norm_sq(), whole.norm_sq())
    torch.testing.assert_close(merged.materialize(), whole.materialize())


@pytest.mark.parametrize("g, t", [(1, 1), (1, 3), (2, 1), (2, 3)])
@pytest.mark.parametrize("o, i", [(3, 5), (5, 3)], ids=["O<I", "O>I"])
@pytest.mark.parametrize("k", [1, 2])
def test_inner_products_each_calls_own_against_the_gradients_formed(g, t, o, i, k):
    """``inner`` and ``inners`` (n calls' examples stacked, each with its own references), by
    whichever side goes through R (one reference) or from G_i formed (several, at several
    positions), against each example's G_i = sum_t s_t a_t^T formed by a loop in float64."""
    n, b = 2, 3
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(n * b, g, t, o, generator=gen, dtype=torch.float64)
    a = torch.randn(n * b, g, t, i, generator=gen, dtype=torch.float64)
    refs = torch.randn(n, k, g * o, i, generator=gen, dtype=torch.float64)
    grads = torch.zeros(n * b, g, o, i, dtype=torch.float64)
    for e in range(n * b):
        for pos in range(t):
            grads[e] += s[e, :, pos, :, None] * a[e, :, pos, None, :]
    each = grads.reshape(n, b, -1) @ refs.reshape(n, k, -1).mT  # (n, B, K)
    part = Outer(s, a, torch.Size((g * o, i)))
    torch.testing.assert_close(part.inners(refs, b), each)
    for c in range(n):
        torch.testing.assert_close(part.examples(c * b, (c + 1) * b).inner(refs[c]), each[c])


def test_formed_inner_products_a_few_calls_at_a_time(monkeypatch):
    """Several references at several positions: each G_i formed, a call at a time where the
    stack's would pass ``CHUNK_ELEMENTS``, with the norms from the same; against the loop."""
    monkeypatch.setattr(outer, "CHUNK_ELEMENTS", 40)
    n, b, t, o, i, k = 3, 2, 3, 6, 8, 3
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(n * b, 1, t, o, generator=gen, dtype=torch.float64)
    a = torch.randn(n * b, 1, t, i, generator=gen, dtype=torch.float64)
    refs = torch.randn(n, k, o, i, generator=gen, dtype=torch.float64)
    grads = torch.stack(
        [sum(s[e, 0, p, :, None] * a[e, 0, p] for p in range(t)) for e in range(n * b)]
    )
    part = Outer(s, a, torch.Size((o, i)))
    assert part._formed_cheaper(k) and not part.forms(train=False)  # the norms alone take the Gram
    want = grads.reshape(n, b, -1) @ refs.reshape(n, k, -1).mT  # (n, B, K)
    torch.testing.assert_close(part.inners(refs, b), want)
    norms, inners = part.examples(0, b).norm_sq_and_inner(refs[0])
    torch.testing.assert_close(inners, want[0])
    torch.testing.assert_close(norms, grads[:b].flatten(1).square().sum(1))


@pytest.mark.parametrize("t", [1, 3])
def test_inner_products_of_references_laid_out_transposed(t):
    """A reference through a preconditioner ((G + lambda I)^-1 g_ref, K-FAC's S^-1 R A^-1) may
    come transposed in memory: the inner products read it by its values, not its strides."""
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(4, 1, t, 3, generator=gen, dtype=torch.float64)  # (B, G, T, O): O < I
    a = torch.randn(4, 1, t, 5, generator=gen, dtype=torch.float64)
    refs = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64).mT  # (K, O, I), transposed
    assert not refs.is_contiguous()
    part = Outer(s, a, torch.Size((3, 5)))
    torch.testing.assert_close(part.inner(refs), part.inner(refs.contiguous()))
    want = part.materialize().flatten(1) @ refs.reshape(2, -1).T  # (B, K)
    torch.testing.assert_close(part.inner(refs), want)


@pytest.mark.parametrize(("t", "k"), [(1, 5), (5, 1), (2, 2), (5, 4)])
def test_inner_forms_g_where_positions_times_references_cost_more(t, k):
    """Past T K > T + K (an LM's positions against --per-ref's references) ``inner`` forms each
    G_i, a product with R; below it, R meets the positions: both the float64 loop's answer."""
    gen = torch.Generator().manual_seed(2)
    s = torch.randn(3, 1, t, 4, generator=gen, dtype=torch.float64)  # (B, G, T, O)
    a = torch.randn(3, 1, t, 6, generator=gen, dtype=torch.float64)
    refs = torch.randn(k, 4, 6, generator=gen, dtype=torch.float64)
    grads = torch.zeros(3, 4, 6, dtype=torch.float64)
    for e in range(3):
        for pos in range(t):
            grads[e] += s[e, 0, pos, :, None] * a[e, 0, pos, None, :]
    want = grads.flatten(1) @ refs.flatten(1).T  # (B, K)
    part = Outer(s, a, torch.Size((4, 6)))
    torch.testing.assert_close(part.inner(refs), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part._inner(refs[:, None]), want, rtol=1e-12, atol=1e-12)


# more inputs than outputs and more outputs than inputs, in one chunk, in chunks of 2 with a
# last of 1, and one example at a time; two groups (attention's q, k, v)
@pytest.mark.parametrize(("g", "o", "i"), [(1, 3, 5), (1, 5, 3), (2, 4, 2)])
@pytest.mark.parametrize("per_chunk", [5, 2, 1])
def test_norms_and_sum_formed_in_one_buffer_are_the_gradients(monkeypatch, g, o, i, per_chunk):
    monkeypatch.setattr(formed, "FORMED_ELEMENTS", per_chunk * g * o * i)
    gen = torch.Generator().manual_seed(3)
    b, t = 5, 4
    s = torch.randn(b, g, t, o, generator=gen, dtype=torch.float64)
    a = torch.randn(b, g, t, i, generator=gen, dtype=torch.float64)
    # each example's gradient by a loop over its positions: (B, G, O, I)
    grads = torch.stack(
        [
            torch.stack(
                [sum(torch.outer(s[n, k, p], a[n, k, p]) for p in range(t)) for k in range(g)]
            )
            for n in range(b)
        ]
    ).reshape(b, g * o, i)
    part = Outer(s, a, torch.Size((g * o, i)))
    assert part.forms(train=True)
    norms, total = part.norm_sq_and_sum()
    torch.testing.assert_close(norms, grads.flatten(1).square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, grads.sum(0), rtol=1e-12, atol=1e-12)


# uneven rows with an example of none, batch 1, rows of one each (no Gram cheaper: not formed)
@pytest.mark.parametrize(
    ("lengths", "g", "t", "o", "i", "forms"),
    [([7, 2, 0, 11, 10, 1], 1, 11, 3, 4, True), ([5], 2, 9, 6, 5, True), ([1, 1, 0], 1, 1, 4, 4, False)],
)  # fmt: skip
def test_norms_and_sum_of_examples_of_their_own_lengths_are_the_gradients(
    lengths, g, t, o, i, forms
):
    """A training step forms each example's G from its own rows (an expert's tokens), no
    padding: the squared norms and batch sum of a loop over each example's rows."""
    torch.manual_seed(4)
    s, a = padded(lengths, g, t, o, i)
    grads = torch.stack(
        [
            torch.stack(
                [
                    sum(
                        (torch.outer(s[n, k, p], a[n, k, p]) for p in range(m)),
                        torch.zeros(o, i, dtype=torch.float64),
                    )
                    for k in range(g)
                ]  # fmt: skip
            )
            for n, m in enumerate(lengths)
        ]
    ).reshape(len(lengths), g * o, i)
    part = Outer(s, a, torch.Size((g * o, i)), lengths)
    assert part.forms(train=True) == forms
    norms, total = part.norm_sq_and_sum()
    torch.testing.assert_close(norms, grads.flatten(1).square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, grads.sum(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("o", "gram"), [(4096, True), (512, False)])
def test_a_large_g_of_few_positions_takes_the_gram(o: int, gram: bool):
    """40 positions, I 32 (CPM-Ant's feed-forward, O 10240): forming a G of O 4096 makes fewer
    products than the Gram, yet writes and reads a large matrix, so the norm takes the Gram; one
    of O 512 (too small for that to matter) is formed, as the products say. Either is exact."""
    t, i = 40, 32
    s, a = padded([t, t, t], 1, t, o, i)
    part = Outer(s, a, torch.Size((o, i)))
    assert part.forms(train=False) is not gram and part.one_gram is gram
    expected = torch.stack([(s[e, 0].mT @ a[e, 0]).square().sum() for e in range(3)])
    torch.testing.assert_close(part.norm_sq(), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(("t", "o", "i"), [(1, 6, 9), (5, 6, 9), (5, 9, 6)], ids=str)
def test_inner_through_r_weights_its_product_in_place(t, o, i):
    """sum_t s_t^T R a_t through R (one position; many; the outputs the wider side): the
    (B, T, K, min(O, I)) product weighted in place before its sum, not copied, so that
    --per-ref's K references hold one such product, not two."""
    g = torch.Generator().manual_seed(7)
    b, k = 16, 8
    s, a = torch.randn(b, 1, t, o, generator=g), torch.randn(b, 1, t, i, generator=g)
    r = torch.randn(k, 1, o, i, generator=g)
    with NewBytes([s, a, r]) as made:
        got = ghost_inner(r, s, a)
    assert made.peak < 2 * b * t * k * min(o, i) * 4
    want = torch.einsum("bgto,kgoi,bgti->bk", s.double(), r.double(), a.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_formed_inner_products_form_no_more_than_the_rows():
    """At two positions of a 16x16 layer each call's G (B, 256) is as large as every call's
    rows: four calls' inner products form one call's G at a time, let go before the next."""
    n, b, t, o, i, k = 4, 3, 2, 16, 16, 3
    gen = torch.Generator().manual_seed(8)
    s, a = torch.randn(n * b, 1, t, o, generator=gen), torch.randn(n * b, 1, t, i, generator=gen)
    refs = list(torch.randn(n, k, o, i, generator=gen))
    part = Outer(s, a, torch.Size((o, i)))
    assert part._formed_cheaper(k)
    with NewBytes([s, a, *refs]) as made:
        got = part.inners(refs, b)
    assert made.peak < 2 * b * o * i * 4
    grads = torch.einsum("bto,bti->boi", s[:, 0].double(), a[:, 0].double()).reshape(n, b, -1)
    want = grads @ torch.stack(refs).double().reshape(n, k, -1).mT  # (n, B, K)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_one_calls_formed_inner_products_form_no_more_than_its_rows():
    """16 positions of a 128x32 layer against 8 references: G formed (T + K products of the
    weight's size an example, not T * K), a few examples at a time, each block let go before
    the next is formed, so that no more of G is held at once than the call's rows (T1's
    --per-ref held every example's G, 1.21x a backward's peak)."""
    b, t, o, i, k = 16, 16, 128, 32, 8
    gen = torch.Generator().manual_seed(9)
    s, a = torch.randn(b, 1, t, o, generator=gen), torch.randn(b, 1, t, i, generator=gen)
    refs = torch.randn(k, o, i, generator=gen)
    part = Outer(s, a, torch.Size((o, i)))
    assert part._formed_cheaper(k) and b * o * i > s.numel() + a.numel()
    with NewBytes([s, a, refs]) as made:
        got = part.inner(refs)
    assert made.peak <= 1.1 * (s.numel() + a.numel()) * 4
    grads = torch.einsum("bto,bti->boi", s[:, 0].double(), a[:, 0].double()).reshape(b, -1)
    want = grads @ refs.double().reshape(k, -1).mT
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
