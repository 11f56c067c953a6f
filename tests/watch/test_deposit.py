"""The watch's deposit: each parameter's gradient over the divisor, scaled in place only where
no other tensor, list or holder reaches its numbers."""

from __future__ import annotations

import torch

from gradscope.training.watch import _scaled


def test_a_gradient_the_deposit_alone_holds_is_scaled_in_place():
    grads = [torch.full((3, 4), 6.0), None, torch.full((5,), 2.0)]
    at = [g.data_ptr() for g in grads if g is not None]
    out = _scaled(grads, torch.tensor(0.5))
    assert grads == [] and out[1] is None  # the list emptied, the None kept in its place
    assert [out[0].data_ptr(), out[2].data_ptr()] == at  # no product beside them
    assert torch.equal(out[0], torch.full((3, 4), 3.0)) and torch.equal(out[2], torch.ones(5))


def test_a_gradient_reached_otherwise_is_left_as_it_was():
    """Autograd's one tensor handed to two parameters, a tensor held elsewhere, a view and two
    gradients on one storage: each parameter's gradient scaled once, the tensors unchanged."""
    shared, held = torch.full((4,), 8.0), torch.full((4,), 8.0)
    base = torch.full((2, 4), 8.0)
    grads = [shared, shared, held, base.view(8), base[0], base[1]]
    del shared  # the list's two references: one product beside it, then it scaled in place
    out = _scaled(grads, torch.tensor(0.25))
    for g in out:
        assert torch.equal(g, torch.full_like(g, 2.0))
    assert torch.equal(held, torch.full((4,), 8.0)) and torch.equal(base, torch.full((2, 4), 8.0))
    assert out[0] is not out[1]
