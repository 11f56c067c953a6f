"""The reducer's inner products held back and answered together (parts of one shape stacked,
each with its own parameter's references) against each example's gradient formed by a loop in
float64, whether the parts are answered at the end or early, past the held elements' bound, or
at once, past a held part's size; and a training step's batch gradients summed from the
examples' (``Want.summed``)."""

from __future__ import annotations

import pytest
import torch

from gradscope.engine.backward import batched
from gradscope.engine.backward.reduce import Reducer, Want
from gradscope.rules import Dense, Outer, Rows, factored
from gradscope.rules import formed as formed_module
from gradscope.rules import outer as outer_module
from gradscope.rules.factored import Factored
from gradscope.rules.formed import Formed
from gradscope.rules.routed import Routed

B, K = 3, 2


def _outer(gen: torch.Generator, t: int, lengths=None) -> tuple[Outer, torch.Tensor]:
    s = torch.randn(B, 1, t, 4, generator=gen, dtype=torch.float64)
    a = torch.randn(B, 1, t, 8, generator=gen, dtype=torch.float64)
    if lengths is not None:
        for b, n in enumerate(lengths):
            s[b, :, n:] = 0
    grads = torch.stack(
        [sum(torch.outer(s[b, 0, p], a[b, 0, p]) for p in range(t)) for b in range(B)]
    )
    return Outer(s, a, torch.Size((4, 8)), lengths), grads


def _routed(gen: torch.Generator, rows: int) -> tuple[Routed, torch.Tensor]:
    """A float32 read of 3 experts' (4, 8) matrices, one row past the last group."""
    a = torch.randn(rows, 8, generator=gen, dtype=torch.float64)
    s = torch.randn(rows, 4, generator=gen, dtype=torch.float64)
    own = torch.randint(0, B, (rows,), generator=gen)
    offs = torch.tensor([2, rows - 3, rows - 1], dtype=torch.int32)
    part = Routed.of(a.float(), s.float(), own, offs, torch.Size((3, 4, 8)), B)
    grads = torch.zeros(B, 3, 4, 8, dtype=torch.float64)
    for r in range(rows - 1):
        grads[own[r], part.expert[r]] += torch.outer(s[r], a[r])
    return part, grads


@pytest.mark.parametrize("held", [batched.HELD_DENSE, 40], ids=["held", "larger at once"])
@pytest.mark.parametrize("bound", [batched.CHUNK_ELEMENTS, 100], ids=["at the end", "early"])
def test_inner_products_held_back_are_each_parameters_own(monkeypatch, bound: int, held: int):
    monkeypatch.setattr(batched, "CHUNK_ELEMENTS", bound)
    monkeypatch.setattr(batched, "HELD_DENSE", held)  # a part of more elements: not held
    gen = torch.Generator().manual_seed(0)
    parts = {
        "o1": _outer(gen, 3),
        "o2": _outer(gen, 3),
        "o3": _outer(gen, 3, lengths=[3, 1, 0]),  # rows of different lengths: alone
        "o4": _outer(gen, 1),
        "r1": _routed(gen, 9),
        "r2": _routed(gen, 12),
    }
    for name in ("d1", "d2"):
        grads = torch.randn(B, 5, generator=gen, dtype=torch.float64)
        parts[name] = (Dense(grads), grads)
    refs = {
        name: torch.randn(K, *grads.shape[1:], generator=gen, dtype=torch.float64)
        for name, (_, grads) in parts.items()
    }
    reducer = Reducer(Want(norms=False, refs=refs), ())
    for name, (part, _) in parts.items():
        reducer.add(name, part)
    reducer.finish()
    assert set(reducer.inner) == set(parts) and not reducer.norm_sq
    for name, (_, grads) in parts.items():
        expected = grads.flatten(1) @ refs[name].flatten(1).T  # (B, K)
        torch.testing.assert_close(
            reducer.inner[name].double(), expected, rtol=1e-5, atol=1e-5, msg=name
        )


def test_factored_references_held_formed_where_their_factors_do_not_pay(monkeypatch):
    """A part whose factored reference pays on it (few positions) answered alone from the
    factors; one whose reference does not (more positions than O * I / (O + I)) held and
    answered with the alike parts, its reference formed; each exact."""
    monkeypatch.setattr(factored, "DISPATCH", 0)
    gen = torch.Generator().manual_seed(1)
    parts = {name: _outer(gen, 3) for name in ("formed", "many", "few")}
    refs = {"formed": torch.randn(K, 4, 8, generator=gen, dtype=torch.float64)}
    for name, n in (("many", 40), ("few", 1)):
        u = torch.randn(K, 1, n, 4, generator=gen, dtype=torch.float64)
        v = torch.randn(K, 1, n, 8, generator=gen, dtype=torch.float64)
        refs[name] = Factored(u, v, torch.Size((4, 8)))
    alone = []
    answer = factored.inner
    monkeypatch.setattr(factored, "inner", lambda c, ref: alone.append(ref) or answer(c, ref))
    reducer = Reducer(Want(norms=False, refs=refs), ())
    for name, (part, _) in parts.items():
        reducer.add(name, part)
    reducer.finish()
    assert alone == [refs["few"]]
    for name, (_, grads) in parts.items():
        ref = refs[name]
        if isinstance(ref, Factored):
            ref = torch.einsum("kgno,kgni->kgoi", ref.u, ref.v).reshape(K, 4, 8)
        expected = grads.flatten(1) @ ref.flatten(1).T
        torch.testing.assert_close(reducer.inner[name], expected, rtol=1e-12, atol=1e-12)


def _rows(gen: torch.Generator, t: int) -> tuple[Rows, torch.Tensor]:
    """Lookups into a (4, 8) table: a tied output head's (4, 8) weight is the same table."""
    ids = torch.randint(0, 4, (B, t), generator=gen)
    s = torch.randn(B, t, 8, generator=gen, dtype=torch.float64)
    grads = torch.zeros(B, 4, 8, dtype=torch.float64)
    for b in range(B):
        for p in range(t):
            grads[b, ids[b, p]] += s[b, p]
    return Rows(ids, s, 4), grads


@pytest.mark.parametrize("chunk", [formed_module.FORMED_ELEMENTS, 40], ids=["one", "chunks"])
def test_a_training_steps_sums_are_the_examples_gradients_summed(monkeypatch, chunk: int):
    monkeypatch.setattr(formed_module, "FORMED_ELEMENTS", chunk)  # G formed a few examples at once
    gen = torch.Generator().manual_seed(1)
    formed = torch.randn(B, 2, 3, generator=gen, dtype=torch.float64)
    parts = {
        "formed": _outer(gen, 5),  # its norm forms each G: the sum from the same chunks
        "gram": _outer(gen, 1),  # one position: no G formed, its sum one product
        "dense": (Dense(formed[:, 0]), formed[:, 0]),
        "conv": (Formed(lambda lo, hi: formed[lo:hi], B, torch.Size((2, 3)), 2), formed),
    }
    (head, head_grads), (table, table_grads) = _outer(gen, 5), _rows(gen, 3)
    train = (torch.zeros(1),)  # a training step's: what the reducer is told of it
    reducer = Reducer(Want(train=train, summed=frozenset([*parts, "tied"])), ["tied"])
    for name, (part, _) in parts.items():
        reducer.add(name, part)
    reducer.add("tied", head)  # a tied table and head: parts of two kinds, reduced apart
    reducer.add("tied", table)
    reducer.finish()
    parts["tied"] = (None, head_grads + table_grads)
    assert reducer.formed == {"formed", "dense", "conv", "tied"}
    for name, (_, grads) in parts.items():
        torch.testing.assert_close(reducer.sums[name], grads.sum(0), msg=name)
        norms = grads.flatten(1).square().sum(1)
        torch.testing.assert_close(reducer.norm_sq[name], norms, msg=name)


@pytest.mark.parametrize("held", [batched.HELD_DENSE, 8], ids=["stacked", "at once"])
def test_formed_gradients_norms_stacked_or_at_once(monkeypatch, held: int):
    monkeypatch.setattr(batched, "HELD_DENSE", held)  # past it, a bias's norm is its own
    gen = torch.Generator().manual_seed(2)
    grads = {name: torch.randn(B, 5, generator=gen, dtype=torch.float64) for name in "abc"}
    grads["d"] = torch.randn(B, 2, generator=gen, dtype=torch.float64)  # under the bound
    reducer = Reducer(Want(), ())
    for name, g in grads.items():
        reducer.add(name, Dense(g))
    reducer.finish()
    for name, g in grads.items():
        torch.testing.assert_close(reducer.norm_sq[name], g.square().sum(1), msg=name)


@pytest.mark.parametrize("rank", [2, 3], ids=["(B, in)", "(B, 1, in)"])
def test_one_position_linears_bias_norm_is_its_weights_factor(monkeypatch, rank: int):
    """||s_i||^2 is the bias's norm and a factor of the weight's: computed once for both."""
    from gradscope.rules import base
    from gradscope.rules.linear import affine_parts

    norms = []  # each squared norm the parts compute, by the shape it reduces
    plain = base._sq_norm
    counted = lambda t: norms.append(tuple(t.shape)) or plain(t)  # noqa: E731
    monkeypatch.setattr(base, "_sq_norm", counted)
    monkeypatch.setattr(outer_module, "_sq_norm", counted)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, *([1] * (rank - 2)), 8, generator=gen, dtype=torch.float64)
    s = torch.randn(B, *([1] * (rank - 2)), 4, generator=gen, dtype=torch.float64)
    reducer = Reducer(Want(), ())
    for name, part in affine_parts(x, s, torch.zeros(4, 8), torch.zeros(4)).items():
        reducer.add(name, part)
    reducer.finish()
    x, s = x.reshape(B, 8), s.reshape(B, 4)
    weight = torch.stack([torch.outer(s[b], x[b]) for b in range(B)])  # the loop's, formed
    torch.testing.assert_close(reducer.norm_sq["weight"], weight.flatten(1).square().sum(1))
    torch.testing.assert_close(reducer.norm_sq["bias"], s.square().sum(1))
    assert sorted(norms) == sorted([(B, 4), (B, 1, 1, 8)])  # s once, a once
