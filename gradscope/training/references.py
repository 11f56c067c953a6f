"""The references' gradients at a recorded run's last weights, where the replay's walk back
begins: a REF the model cannot take, or a row of it whose loss is not finite, one line."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from torch.func import functional_call

from ..config import Config
from ..engine import MAX_PER_REF, non_finite_rows
from ..errors import DataError, models_backward, reading
from ..io.batch import Batch
from ..io.data import open_dataset
from .adjoint import Problem
from .loop import forward_or_error
from .steps import Tensors


def reference_gradients(
    cfg: Config, problem: Problem, final: Tensors, ref: str, per_ref: bool
) -> Tensors:
    """(R, ...) per weight: the gradient at the run's last weights of the mean loss over REF
    (R = 1), or of each reference's loss; the model in eval mode, as influence scores."""
    data = open_dataset(dataclasses.replace(cfg.data, ids=None, limit=None), ref, "--ref")
    if per_ref and len(data) > MAX_PER_REF:
        raise DataError(
            f"--per-ref takes at most {MAX_PER_REF} reference examples; REF has {len(data)}", ref
        )
    params = [p.detach().requires_grad_() for p in final]
    problem.called.eval()
    parts, count = [], 0
    with reading(f"--ref {ref}"):
        for batch in data.batches(cfg.data.batch_size):
            losses = _losses(problem, params, batch, ref, count)  # (B,)
            count += len(losses)
            parts.append(_gradients(losses, params, per_ref))
    if per_ref:
        return [torch.cat(gs) for gs in zip(*parts, strict=True)]
    return [sum(gs) / count for gs in zip(*parts, strict=True)]


def _losses(problem: Problem, params: Tensors, batch: Batch, ref: str, first: int) -> Tensor:
    """(B,) the losses at ``params`` of REF's rows from ``first`` on. A row whose loss is not
    finite (a NaN or inf in REF) is refused for the mean and for ``--per-ref`` alike: it makes
    the mean's gradient NaN, and each reference's of its batch too (the batched backward
    multiplies the other rows' zero cotangents by its NaN), and with them every score."""
    inputs = tuple(problem.rows.move(t) for t in batch.inputs)
    weights = dict(zip(problem.names, params, strict=True))
    output = forward_or_error(
        lambda called, x: functional_call(called, weights, x),
        problem.called, inputs, "on REF", f"--ref {ref}",
    )  # fmt: skip
    losses = problem.loss(output, batch.targets.to(problem.rows.device))
    rows = non_finite_rows(losses, first)
    if rows:
        raise DataError(
            f"the reference's row {rows}: its loss is not finite (a NaN or inf in its inputs or "
            "target?), so the references' gradient (the mean's, or with --per-ref that of every "
            "row of its batch: 0 x NaN in the backward) and the scores through the run against "
            "it would be NaN; leave it out",
            f"--ref {ref}",
        )
    return losses


def _gradients(losses: Tensor, params: Tensors, per_ref: bool) -> Tensors:
    """(B, ...) per weight: each loss's gradient, or (1, ...) their sum's, zeros where the
    losses do not reach a weight; the model's backward's errors one line."""
    with models_backward():
        if per_ref:
            eye = torch.eye(len(losses), dtype=losses.dtype, device=losses.device)
            grads = torch.autograd.grad(
                losses, params, eye, is_grads_batched=True, allow_unused=True
            )
            return _zeros(grads, params, (len(losses),))
        grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        return [g[None] for g in _zeros(grads, params, ())]


def _zeros(grads: Tensors, params: Tensors, lead: tuple[int, ...]) -> Tensors:
    """``grads``, zeros of ``lead`` + the weight's shape where the references do not reach it."""
    pairs = zip(grads, params, strict=True)
    return [p.new_zeros(*lead, *p.shape) if g is None else g for g, p in pairs]
