"""phi_i = P_out^T G_i P_in of parameters read by functions (views placed back: fused experts
``W[e]``, packed chunks, ``x @ W.T``, overlapping reads) and through tensors computed from them,
against the definition on the float64 loop's formed gradients."""

from __future__ import annotations

import pytest
import test_computed
import test_functional as fn
import torch
from oracle import Case, assert_projections_match_loop

CASES = [
    *(
        Case(
            f"reads-{name}",
            lambda block=block: fn.Model(block()),
            lambda b: (torch.randint(0, fn.VOCAB, (b, fn.T)),),
            lambda out: torch.randint(0, out.shape[-1], out.shape[:-1]),
            "cross_entropy",
            batch=4,
        )
        for name, block in fn.BLOCKS.items()
    ),
    *test_computed.CASES,
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_projections_match_loop(case: Case) -> None:
    assert_projections_match_loop(case, rtol=1e-6)  # Model's norm computes in float32
