"""References kept as their factors (``rules.factored``): an Outer's inner products with them,
one call's and several calls' stacked, against R formed; their norms; and the choice of route
by cost, each route exact."""

from __future__ import annotations

import pytest
import torch
from test_outer import padded

from gradscope.rules import Dense, Outer, factored
from gradscope.rules.factored import Factored


@pytest.fixture(autouse=True)
def no_floor(monkeypatch):
    """The factors' route wherever it saves work, however little (``DISPATCH``: below it a
    small layer's batch takes R formed), so that these small shapes take it."""
    monkeypatch.setattr(factored, "DISPATCH", 0)


def _factors(k: int, g: int, n: int, o: int, i: int) -> Factored:
    u, v = torch.randn(k, g, n, o).double(), torch.randn(k, g, n, i).double()
    return Factored(u, v, torch.Size((g * o, i)))


def _formed(r: Factored) -> torch.Tensor:
    """(K, G*O, I) sum_n u_n v_n^T group by group, by einsum: the definition."""
    return torch.einsum("kgno,kgni->kgoi", r.u, r.v).reshape(len(r), *r.param_shape)


# one position, a sequence, groups (a grouped conv's), batch 1, more references than positions
SHAPES = [
    (5, 1, 1, 4, 6, 1, 3),
    (4, 1, 7, 5, 3, 2, 4),
    (3, 3, 5, 2, 4, 3, 2),
    (1, 1, 2, 3, 3, 4, 9),
]


@pytest.mark.parametrize(("b", "g", "t", "o", "i", "k", "n"), SHAPES)
@pytest.mark.parametrize("chunk", [1 << 24, 7], ids=["whole", "in chunks"])
def test_factored_inner_products_are_those_through_r_formed(
    monkeypatch, b, g, t, o, i, k, n, chunk
):
    monkeypatch.setattr(factored, "CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    c = Outer(torch.randn(b, g, t, o).double(), torch.randn(b, g, t, i).double(), (g * o, i))
    r = _factors(k, g, n, o, i)
    expected = torch.einsum("bp,kp->bk", c.materialize().flatten(1), _formed(r).flatten(1))
    torch.testing.assert_close(r.inner(c), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r.dense(), _formed(r))
    torch.testing.assert_close(r.norm_sq(), _formed(r).flatten(1).pow(2).sum(1))


def test_padded_positions_add_nothing():
    """An Outer with ``lengths`` (zeros past each example's rows) against factors of padded
    positions: the answers of R formed."""
    torch.manual_seed(1)
    lengths, g, t, o, i = [7, 2, 0, 11, 10, 1], 1, 11, 16, 16
    s, a = padded(lengths, g, t, o, i)
    c = Outer(s, a, (g * o, i), lengths)
    us, vs = padded([3], g, 5, o, i)  # one direction of 5 positions, the last 2 padding
    r = Factored(us, vs, c.shape)
    torch.testing.assert_close(factored.inner(c, r), c.inner(_formed(r)), rtol=1e-12, atol=1e-12)
    assert r._dense is None  # the factors answered


@pytest.mark.parametrize("norms", [False, True])
def test_the_cheaper_route_is_taken_and_both_are_exact(norms: bool):
    """Few positions of a wide weight: the factors; many positions of a small weight (more than
    O * I / (O + I)): R formed once, kept, and the Outer's own route; a contribution of another
    kind (the fallback's, formed): R formed."""
    torch.manual_seed(2)
    c = Outer(torch.randn(6, 1, 1, 20).double(), torch.randn(6, 1, 1, 30).double(), (20, 30))
    few, many = _factors(1, 1, 2, 20, 30), _factors(1, 1, 40, 20, 30)
    ask = factored.norm_sq_and_inner if norms else factored.inner
    for r, cheap in ((few, True), (many, False)):
        answer = ask(c, r)
        inner = answer[1] if norms else answer
        torch.testing.assert_close(inner, c.inner(_formed(r)), rtol=1e-12, atol=1e-12)
        assert (r._dense is None) == cheap
    dense = Dense(c.materialize())
    torch.testing.assert_close(
        factored.inner(dense, few), c.inner(_formed(few)), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(("positions", "pays"), [((1, 3), True), ((40, 40), False)])
def test_stacked_calls_each_against_its_own_reference(monkeypatch, positions, pays: bool):
    """``inners``: n calls' examples stacked in one Outer, each against its own reference,
    factored or formed: call by call from the factors where they pay on a call's examples;
    where none does (more positions than O * I / (O + I)), those formed and stacked with the
    others, one product for all the calls, none call by call; exact."""
    torch.manual_seed(3)
    batch, n = 4, 3
    c = Outer(
        torch.randn(n * batch, 1, 2, 8).double(), torch.randn(n * batch, 1, 2, 9).double(), (8, 9)
    )
    first, last = positions
    refs = [_factors(2, 1, first, 8, 9), torch.randn(2, 8, 9).double(), _factors(2, 1, last, 8, 9)]
    formed = [r if isinstance(r, torch.Tensor) else _formed(r) for r in refs]
    expected = torch.stack(
        [c.examples(k * batch, (k + 1) * batch).inner(f) for k, f in enumerate(formed)]
    )
    if not pays:
        monkeypatch.setattr(factored, "inner", None)  # call by call would call it
    torch.testing.assert_close(factored.inners(c, refs, batch), expected, rtol=1e-12, atol=1e-12)
    assert all((r._dense is None) == pays for r in refs if isinstance(r, Factored))


def test_a_small_batch_takes_r_formed(monkeypatch):
    """Below ``DISPATCH`` multiply-adds saved over the batch, R formed (its few ops dispatch for
    less); past it, the factors; both exact."""
    monkeypatch.setattr(factored, "DISPATCH", 1 << 20)
    torch.manual_seed(4)
    kept = _factors(1, 1, 2, 20, 30)  # saves 600 - 2 * 51 = 498 multiply-adds an example
    for b, cheap in ((2000, False), (2200, True)):
        r = Factored(kept.u, kept.v, kept.param_shape)  # none formed yet
        c = Outer(torch.randn(b, 1, 1, 20).double(), torch.randn(b, 1, 1, 30).double(), (20, 30))
        torch.testing.assert_close(
            factored.inner(c, r), c.inner(_formed(r)), rtol=1e-12, atol=1e-12
        )
        assert (r._dense is None) == cheap


def test_factors_where_r_formed_would_hold_more_than_the_rows(monkeypatch):
    """A batch too small to pay for the factors' ops by time (T3's first layer against
    --per-ref's 8 references) still takes them where the route through R would hold 8 *
    min(O, I) products a position, more than the position's O + I rows; both exact."""
    monkeypatch.setattr(factored, "DISPATCH", 1 << 20)
    torch.manual_seed(5)
    kept = _factors(8, 1, 1, 64, 32)
    c = Outer(torch.randn(4, 1, 1, 64).double(), torch.randn(4, 1, 1, 32).double(), (64, 32))
    r = Factored(kept.u, kept.v, kept.param_shape)
    torch.testing.assert_close(factored.inner(c, r), c.inner(_formed(r)), rtol=1e-12, atol=1e-12)
    assert r._dense is None  # the factors answered
