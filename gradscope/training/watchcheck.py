"""The first step's check of a framework's watched run: the loss the watch trained the first
batch on must be the one the framework's own step takes of it (a Hugging Face model's own
forward with its labels, a Lightning module's own ``training_step``), computed once more as the
step began (``rerun``). A step of another loss, or of inputs the step changes, is refused by
the framework's callback, not trained on."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engine import computed_in
from ..errors import ModelError
from .watchdraws import SameBuffers, State, set_state, state


def rerun(model: nn.Module, began: State, call: Callable[[], Any]) -> Any:
    """``call()``, without a gradient, drawing from ``began`` (the random state the step began
    in, ``watchdraws.state``: its dropout masks); then the generators and ``model``'s buffers as
    the step left them, so that the run goes on as it would have without the check."""
    after, buffers = state(), SameBuffers(model)
    buffers.begin()  # every buffer kept: the check runs before any is known to change
    set_state(began)
    try:
        with torch.no_grad():
            return call()
    finally:
        set_state(after)
        buffers.again()  # those the call changed, as they were


def agree(mine: float, own: float | None, model: nn.Module) -> bool:
    """Whether the watch's loss of the first batch is the framework's ``own`` (None: it gave
    none), to 1e-4 (2e-2 where the step computed in half precision); a loss not finite is
    refused, whichever way it came."""
    rtol = 1e-4 if computed_in() is None else 2e-2
    if own is not None and abs(mine - own) <= rtol * max(abs(mine), 1e-6):
        return True
    if not math.isfinite(mine):
        raise ModelError(
            f"the first batch's loss is {mine} as the watch takes it and {own} as "
            f"{type(model).__name__} takes it: the model's output is not finite",
            "model",
        )
    return False
