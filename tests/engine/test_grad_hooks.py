"""``hooks.GradHooks``: hooks on the gradients of tensors a pass made, added without torch's
handles. Each sees what ``Tensor.register_hook`` would (the oracle: a hook of torch's own on
the same tensor, in the same backward), replaces the gradient alike, runs in the order added
beside the user's, and is gone after ``clear``; a subclass's and a leaf's registration is
torch's own."""

from __future__ import annotations

import torch
from torch import Tensor

from gradscope.engine.hooks import GradHooks


def _made() -> tuple[Tensor, Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    return x, (x * 2).sin()


def test_sees_and_replaces_what_register_hook_would() -> None:
    x, y = _made()
    theirs: list[Tensor] = []
    ours: list[Tensor] = []
    hooks = GradHooks()
    y.register_hook(theirs.append)
    hooks.add(y, lambda g: ours.append(g) or g * 3)
    w = torch.randn(4, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad((y * w).sum(), x)
    assert torch.equal(theirs[0], w) and torch.equal(ours[0], w)  # in the order added
    expected = 3 * w * 2 * (x * 2).cos()  # the replaced gradient carried on
    torch.testing.assert_close(grad, expected.detach(), rtol=1e-12, atol=0)


def test_gone_after_clear_the_users_kept() -> None:
    x, y = _made()
    theirs: list[Tensor] = []
    ours: list[Tensor] = []
    hooks = GradHooks()
    hooks.add(y, ours.append)
    y.register_hook(theirs.append)
    hooks.clear()
    torch.autograd.grad(y.sum(), x)
    assert not ours and len(theirs) == 1


def test_before_an_in_place_edit_the_unedited_values() -> None:
    """As torch's: a hook added before ``y.mul_(5)`` sees the gradient of ``y`` before it."""
    x, y = _made()
    ours: list[Tensor] = []
    theirs: list[Tensor] = []
    hooks = GradHooks()
    hooks.add(y, ours.append)
    y.register_hook(theirs.append)
    y.mul_(5)
    torch.autograd.grad(y.sum(), x)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[0], torch.full_like(ours[0], 5))


class _Logged(Tensor):
    """A subclass whose ``__torch_function__`` logs what it is handed."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_and_a_leaf_through_register_hook() -> None:
    x, y = _made()
    logged = y.as_subclass(_Logged)
    _Logged.seen.clear()
    got: list[Tensor] = []
    hooks = GradHooks()
    hooks.add(logged, got.append)
    hooks.add(x, got.append)  # a leaf: its gradient's accumulator
    assert Tensor.register_hook in _Logged.seen
    torch.autograd.grad(logged.sum(), x)
    assert len(got) == 2
    hooks.clear()
    assert not x._backward_hooks
