"""The references' gradients at a recorded run's last weights, where the replay's walk back
begins."""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config
from ..engine import MAX_PER_REF
from ..errors import DataError, reading
from ..io.data import open_dataset
from .adjoint import Problem
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
            inputs = tuple(problem.rows.move(t) for t in batch.inputs)
            losses = problem.losses(params, inputs, batch.targets.to(problem.rows.device))  # (B,)
            count += len(losses)
            if per_ref:
                eye = torch.eye(len(losses), dtype=losses.dtype, device=losses.device)
                grads = torch.autograd.grad(
                    losses, params, eye, is_grads_batched=True, allow_unused=True
                )
                parts.append(_zeros(grads, params, (len(losses),)))
            else:
                grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
                parts.append([g[None] for g in _zeros(grads, params, ())])
    if per_ref:
        return [torch.cat(gs) for gs in zip(*parts, strict=True)]
    return [sum(gs) / count for gs in zip(*parts, strict=True)]


def _zeros(grads: Tensors, params: Tensors, lead: tuple[int, ...]) -> Tensors:
    """``grads``, zeros of ``lead`` + the weight's shape where the references do not reach it."""
    pairs = zip(grads, params, strict=True)
    return [p.new_zeros(*lead, *p.shape) if g is None else g for g, p in pairs]
