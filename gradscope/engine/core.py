"""The passes: one forward and one backward that stops at layer outputs, then the rules' math."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..errors import ModelError
from ..io.model import select_output
from ..losses import LossFn
from ..rules import Contribution, find_rule
from .plan import Plan
from .session import HookSession


@dataclass
class BatchScores:
    """What one pass gives for a batch of B examples."""

    loss: Tensor  # (B,) each example's own loss
    norm_sq: dict[str, Tensor]  # parameter name -> (B,) squared norm of its per-example gradient
    inner: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, K) <G_i, refs[name][k]>


@contextlib.contextmanager
def prepared(model: nn.Module, plan: Plan) -> Iterator[None]:
    """Eval mode and ``requires_grad`` on the selected parameters, restored on exit."""
    training = {m: m.training for m in model.modules()}
    requires = {id(p.param): (p.param, p.param.requires_grad) for p in plan.params}
    model.eval()
    try:
        for p in plan.included:
            p.param.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for m, mode in training.items():
            m.train(mode)
        for p, flag in requires.values():
            p.requires_grad_(flag)


class Engine:
    """Per-example gradient quantities of ``model`` under ``loss_fn``, served as ``plan`` says."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, plan: Plan, output: str | int | None = None
    ):
        if plan.fallback:
            names = sorted({p.module for p in plan.fallback})
            raise ModelError(
                "no rule yet for the parameters of: " + ", ".join(names)
                + "; exclude them with params.exclude to score the rest",
                "model",
            )  # fmt: skip
        self.model, self.loss_fn, self.plan, self.output = model, loss_fn, plan, output
        self._copy: set[int] = set()  # modules whose outputs the model later edits in place

    def losses(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """(B,) per-example losses, with the graph kept for the backward."""
        try:
            outputs = self.model(*inputs)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            raise ModelError(
                f"the model cannot take inputs of shape {shapes}: {e}", "data.inputs"
            ) from e
        return self.loss_fn(select_output(outputs, self.output), targets)

    def contributions(
        self, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Contribution | None]]:
        """Per-example losses and, for each parameter a rule serves, its factored gradient."""
        while True:
            with HookSession(self.plan.hooked_modules, self._copy) as session:
                losses = self.losses(inputs, targets)
            edited = session.edited_in_place() - self._copy
            if not edited:
                break
            self._copy |= edited  # capture copies from now on, and redo this batch
        session.backward(losses.sum())
        parts: dict[tuple[int, int], dict[str, Contribution]] = {}
        result: dict[str, Contribution | None] = {}
        for p in self.plan.by_rule:
            total = None
            for module, attr in p.owners:
                rule = find_rule(module)
                for n, call in enumerate(session.calls[id(module)]):
                    if call.grad is None:
                        continue  # this call does not reach the loss
                    key = (id(module), n)
                    if key not in parts:
                        parts[key] = rule.fn(module, call.inputs, call.grad)
                    part = parts[key][attr]
                    total = part if total is None else total.merge(part)
            result[p.name] = total
        return losses.detach(), result

    def norms(
        self, inputs: tuple[Tensor, ...], targets: Tensor, refs: dict[str, Tensor] | None = None
    ) -> BatchScores:
        """Losses and squared norms; with ``refs`` ({name: (K, *shape)}) also the inner products
        of each example's gradient with them, from the same contributions (one forward+backward)."""
        losses, contributions = self.contributions(inputs, targets)
        zeros = losses.new_zeros(losses.shape[0])
        norm_sq = {name: zeros if c is None else c.norm_sq() for name, c in contributions.items()}
        inner: dict[str, Tensor] = {}
        if refs is not None:
            for name, c in contributions.items():
                k = refs[name].shape[0]
                inner[name] = (
                    losses.new_zeros(losses.shape[0], k) if c is None else c.inner(refs[name])
                )
        return BatchScores(loss=losses, norm_sq=norm_sq, inner=inner)
