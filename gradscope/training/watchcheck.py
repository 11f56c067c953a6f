"""The check of a framework's watched run: the loss the watch trained a batch on must be the
one the framework's own step takes of it (a Hugging Face model's own forward with its labels,
a Lightning module's own ``training_step``), computed once more as the step began (``rerun``),
in value and in gradient (``differs``): class weights or label smoothing agree with the plain
loss in value where the model predicts at chance (a head initialised at zero), not in
gradient. Checked on the steps ``Due`` picks, the first among them. A step of another loss, or
of inputs the step changes, is refused by the framework's callback, not trained on."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..engine import computed_in
from ..errors import GradscopeError, ModelError
from .watch import Watch, deposited
from .watchdraws import SameBuffers, State, set_state, state


class Due:
    """Which watched steps are checked: the run's first, each epoch's first (a loss that
    changes with the epoch), and the 2nd, 4th, 8th... it takes (one that changes with the
    step), a forward and backward more each: one an epoch and about log2 of the steps.
    ``floor`` keeps the first check's loss and largest gradient entry: float32's rounding does
    not fall as the loss does, so later ones are compared to no finer than those."""

    def __init__(self):
        self.taken, self.epoch = 0, None
        self.floor: tuple[float, float] | None = None

    def __call__(self, epoch: int) -> bool:
        n = self.taken
        return (n & (n - 1)) == 0 or epoch != self.epoch  # n is 0 or a power of two

    def took(self, epoch: int, checked: bool) -> None:
        self.taken += 1
        self.epoch = epoch if checked else self.epoch


def checked(watch: Watch, due: Due, same: Callable[[Tensor], None], loss: Tensor) -> None:
    """``same(loss)``, a checked step's comparison (``Watch.step``'s ``check``): refused on the
    run's first step, the watch file dropped (no rows of a loss the run does not train on); on
    a later one, the file keeps the steps before it."""
    try:
        same(loss)
    except GradscopeError:
        if not due.taken:
            watch.discard()
        raise


def rerun(model: nn.Module, began: State, call: Callable[[], Any]) -> Any:
    """``call()``, drawing from ``began`` (the random state the step began in,
    ``watchdraws.state``: its dropout masks), its graph kept for its loss's gradient; then the
    generators and ``model``'s buffers as the step left them, so that the run goes on as it
    would have without the check."""
    after, buffers = state(), SameBuffers(model)
    buffers.begin()  # every buffer kept: the check runs before any is known to change
    set_state(began)
    try:
        with torch.enable_grad():
            return call()
    finally:
        set_state(after)
        buffers.again()  # those the call changed, as they were


def differs(
    loss: Tensor, own: object, params: Sequence[Tensor], model: nn.Module, due: Due
) -> str | None:
    """None where the watched step's ``loss`` is the framework's ``own`` (a tensor, else none)
    in value, to 1e-4 of it (2e-2 where the step computed in half precision), and in its
    gradient over ``params`` to the same share of the gradient's largest entry, each no finer
    than the first check's (``due.floor``); else ``own`` told for the caller's line (its value,
    and where that agrees, how far its gradient is). A first loss not finite is refused,
    whichever way it came; a later one is the run's own to meet (the file's ``finite``)."""
    rtol = 1e-4 if computed_in() is None else 2e-2
    mine = loss.item()
    theirs = own.item() if isinstance(own, Tensor) and own.numel() == 1 else None
    floor_loss, floor_gradient = due.floor or (1e-6, 1e-30)
    if theirs is not None and abs(mine - theirs) <= rtol * max(abs(mine), floor_loss):
        apart, largest = _gradients_apart(deposited(loss), own, params)
        if apart <= rtol * max(largest, floor_gradient):
            due.floor = due.floor or (abs(mine), largest)
            return None
        return (
            f"{theirs:.6g} too, yet of another gradient ({apart / max(largest, 1e-30):.2g} of "
            "its largest entry apart: class weights or label smoothing agree in value alone "
            "where the model predicts at chance)"
        )
    if not math.isfinite(mine):
        if due.taken:
            return None
        raise ModelError(
            f"the first batch's loss is {mine} as the watch takes it and {theirs} as "
            f"{type(model).__name__} takes it: the model's output is not finite",
            "model",
        )
    return "none" if theirs is None else f"{theirs:.6g}"


def _gradients_apart(
    mine: list[Tensor | None], own: Tensor, params: Sequence[Tensor]
) -> tuple[float, float]:
    """The largest difference between the watch's gradient over ``params`` and ``own``'s, and
    the watch's largest entry (the difference inf where ``own`` has none: a loss detached)."""
    largest = max((g.abs().max().item() for g in mine if g is not None and g.numel()), default=0)
    if not own.requires_grad:
        return math.inf, largest
    theirs = torch.autograd.grad(own, list(params), allow_unused=True)
    apart = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if a is None and b is None:
            continue
        a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
        apart = max(apart, (a - b).abs().max().item() if a.numel() else 0.0)
    return apart, largest
