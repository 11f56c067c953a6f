"""The probe for calls shared by examples: skipped when the shapes already tell, run once per model
and input shapes, its finding kept for later Engines (per_example_norms builds one per call)."""

from __future__ import annotations

import torch
from oracle import assert_rel_close, reference_norms
from test_fallback import BY_ID

import gradscope


def test_every_call_shared_by_shape_needs_no_probe():
    """Sequence-first Linear with T != B: the leading dimension tells; nothing is left to probe."""
    case = BY_ID["seq-first-t-equals-b"]
    model, inputs, targets = case.build(torch.float64, batch=4)  # T = 5
    got = gradscope.per_example_norms(model, inputs, targets, case.loss)
    assert_rel_close(got, reference_norms(model, inputs, targets, case.loss)[1], 1e-5)
