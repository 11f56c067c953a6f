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


@pytest.mark.parametrize("transposed", [False, True], ids=["W^T", "W"])
def test_keyed_experts_batch_gradient_is_their_examples_sum(monkeypatch, transposed):
    """Grouped experts whose rows' Gram over all rows is not cheap (W9's) are routed all the
    same, each (example, expert)'s rows apart (``Routed.keyed``): on a training step each key's
    gradient formed, the batch gradient their sum, not autograd's, on the analysed step (the
    trace's, by expert) and the replayed ones; the norms are the loop's, the gradient
    autograd's, on batches of uneven loads, and of one example."""
    from moe_models import Block, Experts, H

    from gradscope.engine import Forward, naive_grads, total
    from gradscope.rules import routed

    monkeypatch.setattr(routed, "ROUTED_COST", 0)  # no Gram over all rows cheap
    monkeypatch.setattr(routed, "ROUTED_FLOPS", 0)
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Linear(H, H), Block(Experts(transposed)), nn.Flatten(), nn.Linear(8 * H, 3)
    )
    loss = resolve_loss("cross_entropy")
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    with Engine(model, loss) as engine:
        for batch in (3, 3, 3, 1, 1):
            x, y = torch.randn(batch, 8, H), torch.randint(0, 3, (batch,))
            scores = engine.step((x,), y, params)
            _, grads = naive_grads(model, (x,), y, loss, names, Forward())
            norms = sum(g.flatten(1).double().square().sum(1) for g in grads.values())
            torch.testing.assert_close(total(scores.norm_sq), norms, rtol=1e-5, atol=0)
            expected = torch.autograd.grad(loss(model(x), y).sum(), params)
            for g, e in zip(scores.trained, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        findings = engine.record.at((x,), y)
        assert findings.replays >= 1
    assert {"1.experts.gate_up", "1.experts.down"} <= findings.formed
