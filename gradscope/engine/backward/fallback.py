"""Exact per-example gradients of the parameters no rule serves: torch.func vmap, else a loop."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from ...losses import LossFn
from ...rules import Dense
from ...rules.base import CHUNK_ELEMENTS
from ..forward import Forward
from ..naive import naive_grads
from .substitute import substituted


def short_reason(e: Exception, width: int = 60) -> str:
    """An exception as a plan note: its type and the start of its first line; whole with
    GRADSCOPE_DEBUG=1 (vmap errors run to hundreds of characters)."""
    text = f"{type(e).__name__}: {str(e).strip()}"
    if os.environ.get("GRADSCOPE_DEBUG"):
        return text
    first = text.splitlines()[0]
    return first if len(first) <= width else first[: width - 1].rstrip() + "…"


class Fallback:
    """Per-example gradients of named parameters through the whole model.

    ``vmap`` over the batch of ``grad`` of one example's loss with respect to just those
    parameters (every other parameter and buffer held fixed), in chunks that bound the
    per-example gradients held at once to about ``CHUNK_ELEMENTS``. Where vmap cannot run the
    model (``.item()``, data-dependent control flow, an op without a batching rule that raises),
    the first failure is remembered in ``vmap_error`` and every later batch runs one backward per
    example instead. Both are exact.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, forward: Forward):
        self.model, self.loss_fn, self.forward = model, loss_fn, forward
        self.vmap_error: str | None = None

    def grads(
        self,
        names: Sequence[str],
        inputs: tuple[Tensor, ...],
        targets: Tensor,
        loop: bool = False,
    ) -> tuple[Tensor | None, dict[str, Dense]]:
        """Each example's loss run alone (B,), and {name: Dense (B, *shape)} for each named
        parameter (no losses where no name is); the model must be prepared. ``loop``: one
        backward per example, where one of them needs it."""
        if not names:
            return None, {}
        done = None
        if self.vmap_error is None and not loop:
            try:
                done = self._vmapped(names, inputs, targets)
            except Exception as e:
                # The model already ran eagerly on this very batch, so the failure is vmap's; a
                # genuine error in the model or loss is raised again, readably, by the loop.
                self.vmap_error = short_reason(e)
        if done is None:
            done = naive_grads(self.model, inputs, targets, self.loss_fn, names, self.forward)
        losses, grads = done
        return losses, {n: Dense(g) for n, g in grads.items()}

    def _vmapped(
        self, names: Sequence[str], inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        params = dict(self.model.named_parameters())
        chosen = {n: params[n].detach() for n in names}
        # The rest detached, so no outer autograd graph is recorded through them.
        fixed = {n: p.detach() for n, p in params.items() if n not in chosen}

        def one_loss(theta: dict[str, Tensor], x: tuple[Tensor, ...], y: Tensor) -> Tensor:
            # A batch of one inside vmap: the model and loss see the shapes they always see;
            # through the engine's forward, which may refuse a run of other rows than the
            # batch's (a watched step's, whose forward drew from a generator)
            with substituted(self.model, {**fixed, **theta}):
                out = self.forward(self.model, tuple(t[None] for t in x))
            return self.loss_fn(out, y[None])[0]

        numel = sum(p.numel() for p in chosen.values())
        chunk = max(1, min(targets.shape[0], CHUNK_ELEMENTS // numel))
        with warnings.catch_warnings():
            # ops without a batching rule run as a loop inside vmap: slower, still exact
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            grads, losses = vmap(grad_and_value(one_loss), in_dims=(None, 0, 0), chunk_size=chunk)(
                chosen, inputs, targets
            )
        return losses.detach(), grads
