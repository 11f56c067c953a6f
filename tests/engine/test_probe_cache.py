"""The probe for calls shared by examples: skipped when the shapes already tell, run once per model
and input shapes, its finding kept for later Engines (per_example_norms builds one per call)."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, reference_norms
from test_fallback import BY_ID

import gradscope
from gradscope.engine import session


def test_every_call_shared_by_shape_needs_no_probe():
    """Sequence-first Linear with T != B: the leading dimension tells; nothing is left to probe."""
    case = BY_ID["seq-first-t-equals-b"]
    model, inputs, targets = case.build(torch.float64, batch=4)  # T = 5
    got = gradscope.per_example_norms(model, inputs, targets, case.loss)
    assert_rel_close(got, reference_norms(model, inputs, targets, case.loss)[1], 1e-5)


@pytest.mark.parametrize("case_id", ["shared-call-t-equals-b", "seq-first-t-equals-b"])
def test_second_call_reuses_the_probe_and_stays_exact(case_id: str, monkeypatch):
    case = BY_ID[case_id]
    model, inputs, targets = case.build(torch.float64)
    _, expected = reference_norms(model, inputs, targets, case.loss)
    probes = []
    original = session.HookSession.not_per_example

    def counted(self, batch, probe=None):
        probes.append(probe is not None)
        return original(self, batch, probe)

    monkeypatch.setattr(session.HookSession, "not_per_example", counted)
    for _ in range(2):
        got = gradscope.per_example_norms(model, inputs, targets, case.loss)
        assert_rel_close(got, expected, 1e-5)
    assert probes == [True, False]
    # another batch size is another question: T == B may hold for one and not for the other
    gradscope.per_example_norms(model, tuple(t[:-1] for t in inputs), targets[:-1], case.loss)
    assert probes[-1] is True
