"""The obvious oracle: one backward per example. Slow, exact, used by `gradscope check` and tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..errors import models_backward
from ..losses import LossFn
from .forward import Forward


def naive_grads(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    loss_fn: LossFn,
    names: Sequence[str],
    forward: Forward = Forward(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-example losses (B,) and per-example gradients {name: (B, *shape)}, one example at a time.

    The model must already be in the mode to score in (eval) with the named parameters requiring
    grad. Parameters an example does not reach get zero gradients.
    """
    params = dict(model.named_parameters())
    chosen = [params[n] for n in names]
    losses, grads = [], {n: [] for n in names}
    for i in range(targets.shape[0]):
        loss = loss_fn(forward(model, tuple(t[i : i + 1] for t in inputs)), targets[i : i + 1])[0]
        with models_backward():
            per_param = torch.autograd.grad(loss, chosen, allow_unused=True)
        losses.append(loss.detach())
        for n, p, g in zip(names, chosen, per_param, strict=True):
            grads[n].append(torch.zeros_like(p) if g is None else g)
    return torch.stack(losses), {n: torch.stack(g) for n, g in grads.items()}
