"""The model as a pass needs it (``prepared``: eval mode, the selected parameters requiring
grad), and torch.compile set aside while any Engine is entered: a compiled model or module runs
its forward eagerly, op by op, for the hooks and the trace to see (compiled, it fails inside dynamo
under the trace's torch function mode).

dynamo's stance is one global, and ``set_stance`` puts back on exit the stance it found on
entry: Engines left in another order than they were entered (a run's own Engine closes before
those of its other checkpoints) would leave ``force_eager`` behind. So the Engines entered are
counted, and the stance the first found is put back when the last one leaves, in any order."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .plan import Plan


class _Eager:
    def __init__(self):
        self.entered = 0
        self.held: contextlib.AbstractContextManager | None = None  # dynamo's, while entered

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.entered += 1
        try:
            if self.held is None:
                # dynamo not loaded: nothing is compiled (importing it costs a process ~1.5 s)
                dynamo = sys.modules.get("torch._dynamo")
                stance = getattr(dynamo, "set_stance", None)  # torch 2.6 on
                if stance is not None:
                    self.held = stance("force_eager")  # set as it is made
            yield
        finally:
            self.entered -= 1
            if not self.entered and self.held is not None:
                self.held.__exit__(None, None, None)
                self.held = None


eager = _Eager()


@contextlib.contextmanager
def prepared(
    model: nn.Module, plan: Plan, modules: Sequence[nn.Module] | None = None
) -> Iterator[None]:
    """Eval mode and ``requires_grad`` on the selected parameters, restored on exit; nothing
    touched where the model is so already (the API enters it on every call). ``modules``: the
    model's, where the caller keeps them (a walk of a large model costs a pass ~0.5 ms).
    ``torch.compile`` set aside meanwhile (``eager``)."""
    training = [(m, m.training) for m in (model.modules() if modules is None else modules)]
    frozen = [p.param for p in plan.included if not p.param.requires_grad]
    if any(mode for _, mode in training):
        model.eval()
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.enable_grad(), eager():
            yield
    finally:
        for m, mode in training:  # parents first: train() sets a module's children
            if m.training != mode:
                m.train(mode)
        for p in frozen:
            p.requires_grad_(False)
