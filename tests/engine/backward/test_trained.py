"""A training step's batch gradients (``Engine.step``) are taken the same way on every step of a
signature: the first, analysed and self-checked, and a later one, replayed, give the same bits
on the same weights and batch; and each equals autograd's batch gradient in float64."""

from __future__ import annotations

import pytest
import torch
from tied_seq import TiedSeq
from torch import nn

from gradscope.engine import Engine
from gradscope.losses import resolve_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_first_and_later_steps_of_a_signature_give_the_same_bits(dtype):
    torch.manual_seed(5)
    model = TiedSeq().to(dtype)
    batch = torch.randint(0, 11, (3, 6))
    params = [p for p in model.parameters() if p.requires_grad]
    engine = Engine(model, resolve_loss("causal_lm", {}, token_reduction="sum"))
    with engine:
        first = engine.step((batch,), batch, params)
        later = engine.step((batch,), batch, params)
        findings = engine.record.at((batch,), batch)
    assert (findings.analyses, findings.replays) == (1, 1)
    assert {"tok.weight", "ff.weight", "ff.bias", "norm.weight"} <= findings.formed
    for g, h in zip(first.trained, later.trained, strict=True):
        assert torch.equal(g, h)
    if dtype == torch.float64:  # and each is autograd's, to rounding
        logits = model(batch)[:, :-1]
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
        )
        for g, e in zip(later.trained, torch.autograd.grad(loss, params), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
