"""``Routed`` where the Gram over all its rows costs more than the read (``keyed``: W9's wide
experts): each (example, expert) key's rows apart, its own Gram or its G formed; on a training
step (``norm_sq_and_sum``) the norms and batch sum from each G formed once. Against each row's
outer product added up by a loop in float64."""

from __future__ import annotations

import pytest
import torch

from gradscope.rules import keyed as keying
from gradscope.rules import routed
from gradscope.rules.routed import Routed, gram_cheap

E, IN, OUT = 4, 5, 6


@pytest.fixture(autouse=True)
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Gram over all rows cheap: every Routed here is ``keyed``."""
    monkeypatch.setattr(routed, "ROUTED_COST", 0)
    monkeypatch.setattr(routed, "ROUTED_FLOPS", 0)


def _case(counts: list[list[int]], transposed: bool, seed: int = 0):
    """Rows laid out as ``grouped_mm`` takes them (sorted by expert; two rows past the last
    group, of no expert), ``counts[b][e]`` of example b run by expert e, the examples' rows
    shuffled within each expert; the Routed in float64, and each example's gradient by hand."""
    g = torch.Generator().manual_seed(seed)
    batch = len(counts)
    expert = [e for e in range(E) for b in range(batch) for _ in range(counts[b][e])]
    own = [b for e in range(E) for b in range(batch) for _ in range(counts[b][e])]
    own = torch.tensor(own + [0, batch - 1], dtype=torch.long)
    ends = torch.tensor([sum(c[e] for c in counts) for e in range(E)]).cumsum(0)
    for lo, hi in zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True):
        own[lo:hi] = own[lo:hi][torch.randperm(hi - lo, generator=g)]
    rows = len(own)
    a = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    s = torch.randn(rows, OUT, generator=g, dtype=torch.float64)
    shape = torch.Size((E, IN, OUT) if transposed else (E, OUT, IN))
    expected = torch.zeros(batch, *shape, dtype=torch.float64)
    for r, e in enumerate(expert):
        outer = torch.outer(a[r], s[r]) if transposed else torch.outer(s[r], a[r])
        expected[own[r], e] += outer
    part = Routed.of(a, s, own, ends.to(torch.int32), shape, batch, transposed)
    return part, expected


# uneven loads with expert 1 given no row; example 1 given none; a batch of 1; keys of one row
# (their Gram cheaper) beside keys of many (their G formed)
CASES = {
    "uneven": [[3, 0, 1, 7], [0, 0, 0, 0], [5, 0, 2, 1]],
    "batch 1": [[4, 1, 0, 9]],
    "one row each": [[1, 1, 1, 1], [1, 1, 1, 1]],
}


@pytest.mark.parametrize("counts", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_keyed_norms_and_sums_are_the_rows_added_by_hand(counts, transposed):
    part, expected = _case(counts, transposed)
    assert part.keyed and part.forms(train=True) and not part.forms(train=False)
    assert not part.one_gram  # no read batched into one Gram with others
    flat = expected.flatten(1)
    norms, total = part.norm_sq_and_sum()
    torch.testing.assert_close(norms, flat.square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, expected.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part.norm_sq(), flat.square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part.batch_sum(), expected.sum(0), rtol=1e-12, atol=1e-12)
    # the rows of no expert zeroed where an answer reads the output gradients whole
    refs = torch.randn(2, *expected.shape[1:], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(part.inner(refs.double()), flat @ refs.double().flatten(1).T)
    torch.testing.assert_close(part.materialize(), expected)
    merged = part.merge(part)  # two calls' rows: each key's pairs across them too
    assert merged.keyed
    torch.testing.assert_close(merged.norm_sq(), 4 * flat.square().sum(1))
    # its rows of no expert in the last expert's keys, their output gradients zero
    norms, total = merged.norm_sq_and_sum()
    torch.testing.assert_close(norms, 4 * flat.square().sum(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, 2 * expected.sum(0), rtol=1e-12, atol=1e-12)
    some = part.examples(1, len(counts)) if len(counts) > 1 else part.examples(0, 1)
    lo = 1 if len(counts) > 1 else 0
    torch.testing.assert_close(some.norm_sq_and_sum()[0], flat[lo:].square().sum(1))


@pytest.mark.parametrize("block", [7, 6, 30], ids=["apart", "blocks", "one block"])
@pytest.mark.parametrize("cost", [0, keying.GRAM_FORMED, 10**6], ids=["formed", "both", "Grams"])
@pytest.mark.parametrize("counts", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_training_steps_keys_of_few_rows_take_their_gram(
    monkeypatch, counts, transposed, cost, block
):
    """On a training step a key of few rows (n^2 (out + in) <= ``GRAM_FORMED`` out in: here 4
    or fewer of 6 x 5) takes its Gram, its rows in its expert's one product for the sum; the
    others their G formed: an expert of both, of one or the other, of none, and every key either
    way give the loop's norms and sum. A formed G whose size ``BLOCK`` divides is reduced by
    blocks into one buffer for all (none apart), else each apart (``_sq_norm``)."""
    monkeypatch.setattr(keying, "GRAM_FORMED", cost)
    monkeypatch.setattr(keying, "BLOCK", block)
    grams, gram_sq, apart, sq_norm = [], keying.gram_sq, [], keying._sq_norm
    monkeypatch.setattr(keying, "gram_sq", lambda a, b: grams.append(len(a)) or gram_sq(a, b))
    monkeypatch.setattr(keying, "_sq_norm", lambda t: apart.append(t) or sq_norm(t))
    part, expected = _case(counts, transposed)
    few = [n for row in counts for n in row if n > 0 and n * n * (IN + OUT) <= cost * IN * OUT]
    formed = [n for row in counts for n in row if n * n * (IN + OUT) > cost * IN * OUT]
    norms, total = part.norm_sq_and_sum()
    assert sorted(grams) == sorted(few)  # each read as its Gram alone
    assert len(apart) == (len(formed) if IN * OUT % block else 0)
    torch.testing.assert_close(norms, expected.flatten(1).square().sum(1), rtol=1e-12, atol=0)
    torch.testing.assert_close(total, expected.sum(0), rtol=1e-12, atol=1e-12)


def test_one_linears_weight_read_on_rows_a_value_picked():
    """``one``: an expert's own (O, I) Linear read whole on rows of any example: its batch sum
    in the Linear's shape."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(9, IN, generator=g, dtype=torch.float64)
    s = torch.randn(9, OUT, generator=g, dtype=torch.float64)
    own = torch.tensor([2, 0, 0, 2, 2, 1, 0, 2, 2])
    part = Routed(a, s, own, torch.zeros(9, dtype=torch.long), (OUT, IN), 3, False, one=True)
    expected = torch.zeros(3, OUT, IN, dtype=torch.float64).index_add_(
        0, own, s[:, :, None] * a[:, None]
    )
    norms, total = part.norm_sq_and_sum()
    torch.testing.assert_close(norms, expected.flatten(1).square().sum(1))
    torch.testing.assert_close(total, expected.sum(0))
    assert total.shape == (OUT, IN)


def test_the_gram_over_all_rows_where_cheap(monkeypatch: pytest.MonkeyPatch):
    """W9's read (4,096 rows of 8 experts of 1,024 x 256) is keyed; H4's (128 rows of 256 x 64)
    and a tiny one (a few multiply-adds in all) take the Gram over all rows."""
    monkeypatch.undo()
    assert gram_cheap(128, torch.Size((8, 256, 64)))
    assert not gram_cheap(4096, torch.Size((8, 1024, 256)))
    assert gram_cheap(30, torch.Size((4, 24, 8)))


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_reads_of_one_offsets_read_their_keys_counts_once(transposed):
    """Two reads of one grouped product's offsets on rows of the same examples (a layer's
    gate-up and down) key their rows the same: the keys' counts are read on the host once for
    both, and each read's norms are its own; once the examples are written to, read again."""
    from syncs import counted

    batch = len(CASES["uneven"])
    part, expected = _case(CASES["uneven"], transposed)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(part.a.shape[0], 8, generator=g, dtype=torch.float64)
    s = torch.randn(part.a.shape[0], 12, generator=g, dtype=torch.float64)
    shape = torch.Size((E, 8, 12) if transposed else (E, 12, 8))

    def norms(own: torch.Tensor) -> torch.Tensor:  # the second read's, row by row
        grads = torch.zeros(batch, *shape, dtype=torch.float64)
        for r, e in enumerate(part.expert.tolist()):
            if e < E:
                outer = torch.outer(a[r], s[r]) if transposed else torch.outer(s[r], a[r])
                grads[own[r], e] += outer
        return grads.flatten(1).square().sum(1)

    second = Routed.of(a, s, part.own, part.offs, shape, batch, transposed)
    with counted() as calls:
        got = [part.norm_sq(), second.norm_sq()]
    assert calls == ["tolist"]
    torch.testing.assert_close(got[0], expected.flatten(1).square().sum(1))
    torch.testing.assert_close(got[1], norms(part.own))
    part.own[0] = (part.own[0] + 1) % batch  # expert 0's first row given to another example
    third = Routed.of(a, s, part.own, part.offs, shape, batch, transposed)
    with counted() as calls:
        got = third.norm_sq()
    assert calls == ["tolist"]  # its keys' counts read again
    torch.testing.assert_close(got, norms(part.own))
