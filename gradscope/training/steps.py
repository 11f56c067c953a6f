"""The recipe's optimizer steps as functions of (parameters, state, gradient), written out as
PyTorch's ``SGD``, ``Adam`` and ``AdamW`` and ``clip_grad_norm_`` compute them, so that autograd
differentiates a step: what the reverse replay carries its adjoints back through."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import TrainConfig
from ..errors import DataError

OPTIMIZERS = ("sgd", "adam", "adamw")
Tensors = list[Tensor]


def clip(grads: Tensors, max_norm: float | None) -> Tensors:
    """``torch.nn.utils.clip_grad_norm_``: every gradient times min(1, c / (||g|| + 1e-6)),
    ||g|| the global L2 norm."""
    if max_norm is None:
        return grads
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])  # (n,)
    coef = torch.clamp(max_norm / (torch.linalg.vector_norm(norms) + 1e-6), max=1.0)
    return [g * coef for g in grads]


def _sqrt(v: Tensor) -> Tensor:
    """sqrt(v), with derivative 0 where v is 0 (not inf): a second moment is 0 only where
    every gradient so far was 0, where the first moment, which multiplies it, is 0 too."""
    positive = v > 0
    return torch.where(positive, torch.where(positive, v, torch.ones_like(v)).sqrt(), 0.0)


@dataclass(frozen=True)
class Update:
    """One optimizer step of ``train``'s recipe, pure: ``(params, state, grads, lr, t)`` to the
    next ``(params, state)``, ``t`` the 0-based step. The state is a flat list: nothing (plain
    SGD), each parameter's momentum buffer, or each one's first moments then second moments."""

    train: TrainConfig

    def __post_init__(self) -> None:
        if self.train.optimizer not in OPTIMIZERS:
            raise DataError(
                f"the run's optimizer {self.train.optimizer!r} is none gradscope can replay "
                f"({', '.join(OPTIMIZERS)})",
                "train.optimizer",
            )

    @property
    def slots(self) -> int:
        """State tensors per parameter."""
        if self.train.optimizer == "sgd":
            return 1 if self.train.momentum else 0
        return 2

    def state_of(self, optimizer: torch.optim.Optimizer, params: Tensors) -> Tensors:
        """The state of PyTorch's ``optimizer`` over ``params`` in this step's layout (a state
        not made yet, before the first step: zeros, which the first step treats alike)."""
        keys = {0: [], 1: ["momentum_buffer"], 2: ["exp_avg", "exp_avg_sq"]}[self.slots]
        state = []
        for key in keys:
            for p in params:
                value = optimizer.state.get(p, {}).get(key)
                state.append(torch.zeros_like(p) if value is None else value.detach().clone())
        return state

    def __call__(
        self, params: Tensors, state: Tensors, grads: Tensors, lr: float, t: int
    ) -> tuple[Tensors, Tensors]:
        if self.train.optimizer == "sgd":
            return self._sgd(params, state, grads, lr)
        return self._adam(params, state, grads, lr, t + 1)

    def _sgd(
        self, params: Tensors, state: Tensors, grads: Tensors, lr: float
    ) -> tuple[Tensors, Tensors]:
        wd, momentum = self.train.weight_decay, self.train.momentum
        steps = [g + wd * p if wd else g for p, g in zip(params, grads, strict=True)]
        if not momentum:
            return [p - lr * d for p, d in zip(params, steps, strict=True)], []
        # the first step's buffer is the step itself: momentum * 0 + d (dampening 0)
        bufs = [momentum * b + d for b, d in zip(state, steps, strict=True)]
        if self.train.nesterov:
            steps = [d + momentum * b for d, b in zip(steps, bufs, strict=True)]
        else:
            steps = bufs
        return [p - lr * d for p, d in zip(params, steps, strict=True)], bufs

    def _adam(
        self, params: Tensors, state: Tensors, grads: Tensors, lr: float, step: int
    ) -> tuple[Tensors, Tensors]:
        beta1, beta2 = self.train.betas
        wd, eps, n = self.train.weight_decay, self.train.eps, len(params)
        if self.train.optimizer == "adamw":
            params = [p * (1 - lr * wd) for p in params]
        elif wd:
            grads = [g + wd * p for p, g in zip(params, grads, strict=True)]
        ms = [m + (1 - beta1) * (g - m) for m, g in zip(state[:n], grads, strict=True)]  # lerp
        vs = [v * beta2 + (1 - beta2) * g * g for v, g in zip(state[n:], grads, strict=True)]
        step_size = lr / (1 - beta1**step)
        correction = (1 - beta2**step) ** 0.5
        moved = [
            p - step_size * m / (_sqrt(v) / correction + eps)
            for p, m, v in zip(params, ms, vs, strict=True)
        ]
        return moved, ms + vs
