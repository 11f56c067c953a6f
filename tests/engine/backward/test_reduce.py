"""The reducer's inner products held back and answered together (parts of one shape stacked,
each with its own parameter's references) against each example's gradient formed by a loop in
float64, whether the parts are answered at the end or early, past the held elements' bound."""

from __future__ import annotations

import pytest
import torch

from gradscope.engine.backward import batched
from gradscope.engine.backward.reduce import Reducer, Want
from gradscope.rules import Dense, Outer
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


@pytest.mark.parametrize("bound", [batched.CHUNK_ELEMENTS, 100], ids=["at the end", "early"])
def test_inner_products_held_back_are_each_parameters_own(monkeypatch, bound: int):
    monkeypatch.setattr(batched, "CHUNK_ELEMENTS", bound)
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
