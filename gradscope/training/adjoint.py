"""One step of a recorded run, forward and in reverse: the weights and optimizer state it moves
from and to, and the adjoint it carries back, with each row's share of it.

A step is theta', s' = U(theta, s, clip(g)), g = grad (1/B) sum_i w_i l_i(theta) at w = 1 (a
run whose loss was the mean over each step's counted tokens: (1/N) sum_i w_i n_i l_i, row i
counting n_i of the step's N, l_i the mean over its own). Given
the adjoints (lambda', sbar') of (theta', s'), one double backward of <(lambda', sbar'), U(...)>
with respect to (theta, s, w) gives lambda and sbar (through U and clip, and through g as a
Hessian-vector product) and d/dw_i, each row's inner product of its gradient with the adjoint
that reaches g, over B. R references' adjoints go back together, sharing the step's forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..errors import ModelError
from ..job import Forward
from ..losses import LossFn, counted
from .loop import TrainingRows
from .record import set_rng
from .steps import Tensors, Update, clip


class Called(nn.Module):
    """The model called as the config calls it, so that ``functional_call`` can swap its weights."""

    def __init__(self, model: nn.Module, forward: Forward):
        super().__init__()
        self.model = model
        self.call = forward

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.call(self.model, inputs)


@dataclass
class Problem:
    """What every step of a replay runs: the model with the weights it is given, the training
    rows, the loss, the recipe's update and clip."""

    called: Called
    names: list[str]  # the trained parameters' names in ``called``, in the run's order
    rows: TrainingRows
    loss: LossFn
    update: Update
    max_norm: float | None
    tokens: tuple[str, int] | None = None  # (loss name, ignore_index): a mean over tokens

    def losses(self, params: Tensors, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """(B,) the per-example losses of the model at ``params``."""
        output = functional_call(self.called, dict(zip(self.names, params, strict=True)), inputs)
        return self.loss(output, targets)

    def step_loss(self, params: Tensors, picked: Tensor, weights: Tensor | None) -> Tensor:
        """The step's training loss, (1/B) sum_i w_i l_i, over the rows at ``picked``; over
        the step's counted tokens, (1/N) sum_i w_i n_i l_i, where ``tokens``."""
        inputs, targets = self.rows.batch(picked)
        losses = self.losses(params, inputs, targets)  # (B,)
        w = torch.ones_like(losses) if weights is None else weights
        if self.tokens is None:
            return (losses * w).sum() / len(losses)
        n = counted(self.tokens[0], targets, self.tokens[1]).flatten(1).sum(1).to(losses.dtype)
        return (losses * w * n).sum() / n.sum()

    def forward(
        self, params: Tensors, state: Tensors, picked: Tensor, lr: float, t: int
    ) -> tuple[Tensors, Tensors]:
        """Step ``t`` as the run took it, on the rows at ``picked``, from the random state
        the caller set."""
        params = [p.detach().requires_grad_() for p in params]
        loss = self.step_loss(params, picked, None)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        self._reached(grads, t)
        with torch.no_grad():
            return self.update(
                [p.detach() for p in params], state, clip(list(grads), self.max_norm), lr, t
            )

    def _reached(self, grads: Tensors, t: int) -> None:
        """Every trained weight's gradient at step ``t``: one the step's loss does not reach
        is skipped by torch's optimizers that step (no decay, no momentum), which the recipe's
        update does not retrace."""
        for name, g in zip(self.names, grads, strict=True):
            if g is None:
                raise ModelError(
                    f"parameter {name.removeprefix('model.')} gets no gradient at step {t}, the "
                    "first the replay recomputes (the forward does not use it): torch's "
                    "optimizers skip it there, which a replay does not retrace; freeze it "
                    "(requires_grad=False) or leave it out of the model",
                    "model.factory",
                )

    def reverse(
        self, at: tuple[Tensors, Tensors, dict], picked: Tensor, lr: float, t: int,
        adjoints: Tensors, batched: bool = True,
    ) -> tuple[Tensors, Tensor, Tensors]:  # fmt: skip
        """Step ``t`` from ``at`` (its weights, state and random state) in reverse: ``adjoints``,
        (R, ...) per weight then per state tensor after the step, to the same before it, and
        (R, B) d/dw_i of the step's rows; and the weights the step moved to, which the caller
        checks are the run's. The R adjoints share the step's forward and first backward; the
        double backward is one vmapped call (``batched``) or one call each."""
        params = [p.detach().requires_grad_() for p in at[0]]
        state = [s.detach().requires_grad_() for s in at[1]]
        set_rng(at[2])  # the dropout masks of the run's step
        weights = torch.ones(len(picked), dtype=params[0].dtype, device=params[0].device)
        weights.requires_grad_()
        loss = self.step_loss(params, picked, weights)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        moved, kept = self.update(params, state, clip(list(grads), self.max_norm), lr, t)
        leaves, outputs = [*params, *state, weights], [*moved, *kept]
        r = adjoints[0].shape[0]
        if batched and r > 1:
            back = _backward(outputs, leaves, adjoints, batched=True)
        else:
            each = [
                _backward(outputs, leaves, [a[k] for a in adjoints], retain=k < r - 1)
                for k in range(r)
            ]
            back = [torch.stack(b) for b in zip(*each, strict=True)]
        return back[:-1], back[-1], [m.detach() for m in moved]  # (R, ...) per leaf; (R, B)


def _backward(
    outputs: Tensors,
    leaves: Tensors,
    adjoints: Tensors,
    batched: bool = False,
    retain: bool = False,
) -> Tensors:
    """The vector-Jacobian product of ``outputs`` with ``adjoints`` at ``leaves`` (batched: a
    leading dimension of adjoints), zeros for a leaf the outputs do not reach."""
    back = torch.autograd.grad(
        outputs, leaves, adjoints, retain_graph=retain, allow_unused=True, is_grads_batched=batched
    )
    shape = (adjoints[0].shape[0],) if batched else ()
    return [
        x.new_zeros(*shape, *x.shape) if b is None else b for b, x in zip(back, leaves, strict=True)
    ]
