"""phi_i = P_out^T G_i P_in from every layer rule, against the definition on the float64 loop's
formed gradients (``oracle.assert_projections_match_loop``)."""

from __future__ import annotations

import pytest
import test_attention
import test_outer
import test_rules
import torch
from oracle import SIDES, Case, assert_projections_match_loop, assert_rel_close, projected

import gradscope.rules.base as base
from gradscope.rules import Outer
from gradscope.rules.projection import Projection

CASES = [*test_rules.CASES, *test_attention.CASES]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_projections_match_loop(case: Case) -> None:
    assert_projections_match_loop(case)


@pytest.mark.parametrize(
    "case", [c for c in test_rules.CASES if c.id.startswith("conv2d")], ids=repr
)
def test_projections_of_gradients_formed_a_few_at_a_time(case: Case, monkeypatch) -> None:
    """Past the bound on one temporary a conv's gradients are Formed: projected chunk by chunk."""
    monkeypatch.setattr(base, "CHUNK_ELEMENTS", 1)
    assert_projections_match_loop(case)


@pytest.mark.parametrize("sides", SIDES)
@pytest.mark.parametrize(("lengths", "g", "t", "o", "i"), test_outer.CASES)
def test_projections_of_rows_of_uneven_lengths(lengths, g, t, o, i, sides):
    """An Outer whose examples hold different numbers of rows: each group of similar length
    projected on its own, the same answer as the whole padded product's."""
    torch.manual_seed(0)
    s, a = test_outer.padded(lengths, g, t, o, i)
    shape = torch.Size((g * o, i))
    p_out = None if sides == "rows whole" else torch.randn(g * o, 2).double()
    p_in = None if sides == "cols whole" else torch.randn(i, 3).double()
    p = Projection(shape, 1, p_out, p_in)
    grads = torch.einsum("bgto,bgti->bgoi", s, a).reshape(len(lengths), *shape)
    assert_rel_close(
        Outer(s, a, shape, lengths).project(p), projected(grads, 1, p_out, p_in), 1e-12
    )
