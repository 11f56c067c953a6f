"""The self-check of a batch analysed in full: each rule-served parameter's per-example
gradients must add up to autograd's batch gradient, and two single examples' must match their
own backward; an error that cancels in the batch sum shows in the singles.

Both compare the norm of the difference, not each element, within ``ROUNDING``: the rules and
autograd read the same output gradients and inputs, so in float32 they differ by the rounding of
their last sums (at most 8e-7 of the terms summed on the sweep's models at width 256, batch 8,
128 tokens), and 1e-3, a rule off by 0.999, is 30 times the share allowed. In float64 the share
is float32's rounding, which a model's own casts (Mamba's scan, in float32) leave in autograd's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch
from torch import Tensor

from ...errors import ModelError, models_backward

# the coarsest dtype the thread's latest forward computed in, where coarser than float32 (a
# hooked call's output in bfloat16 under autocast, whose float32 results round as it does):
# each pass notes it after its forward, so every check of the pass compares at its rounding
COMPUTED: ContextVar[torch.dtype | None] = ContextVar("computed", default=None)


def computed_in() -> torch.dtype | None:
    """The dtype coarser than float32 the thread's latest pass computed in (a hooked call's
    output in bfloat16 or float16: autocast's, or a half-precision model's), else None."""
    return COMPUTED.get()


def tolerance(dtype: torch.dtype) -> float:
    """The worst relative error a correct engine stays under, given rounding in ``dtype``, or
    in the dtype the forward computed in where coarser."""
    if COMPUTED.get() is not None and dtype in (torch.float32, torch.float64):
        dtype = COMPUTED.get()
    return {torch.float64: 1e-6, torch.float32: 1e-4}.get(dtype, 1e-2)


# (relative, floor) per precision: the share of the terms' magnitude two sums of one gradient
# may differ by, and the share of the whole model's gradient (``close``). "reduced": float32
# products at a lower precision (TF32 on CUDA, where set: cuDNN's convolutions by default)
ROUNDING = {
    torch.float64: (1e-6, 1e-6),
    torch.float32: (3e-5, 1e-7),
    "reduced": (1e-2, 1e-4),
}
LOW = (1e-1, 1e-2)  # bfloat16, float16


def precision(param: Tensor, conv: bool) -> torch.dtype | str:
    """The precision autograd's and the rules' products of ``param``'s gradient run at (a
    ``ROUNDING`` key); ``conv`` where a convolution reads it. Where the forward computed in a
    coarser dtype (``COMPUTED``: autocast, a ``Trainer`` with ``bf16=True``), that one."""
    if param.dtype != torch.float32:
        return param.dtype
    if COMPUTED.get() is not None:
        return COMPUTED.get()
    reduced = torch.get_float32_matmul_precision() != "highest"
    if param.is_cuda:
        reduced |= torch.backends.cuda.matmul.allow_tf32
        reduced |= conv and torch.backends.cudnn.allow_tf32
    return "reduced" if reduced else param.dtype


def close(
    ours: Tensor, theirs: Tensor, at: torch.dtype | str, scale: float = 0.0, total: float = 0.0
) -> bool:
    """``ours`` equals autograd's ``theirs`` up to the rounding of a sum at precision ``at``:
    ``||ours - theirs||`` under ``ROUNDING``'s share of the larger of their norms and
    ``scale``, the magnitude of the terms they sum (the examples' gradient norms, summed: near
    a minimum the batch gradient is far smaller than they are), plus its floor's share of
    ``total``, the norm of the whole model's gradient, for a gradient zero but for rounding
    (the key bias of an attention layer, which softmax cancels within each example). NaN where
    both are."""
    rtol, floor = ROUNDING.get(at, LOW)
    ours, theirs = ours.double(), theirs.to(ours.device).double()
    if not torch.equal(ours.isnan(), theirs.isnan()):
        return False
    ours, theirs = ours.nan_to_num(0), theirs.nan_to_num(0)
    own = max(ours.norm().item(), theirs.norm().item(), scale)
    return (ours - theirs).norm().item() <= rtol * own + floor * total


def agrees(ours: Tensor, theirs: Tensor, total: float = 0.0) -> bool:
    """Equal up to rounding in ``theirs``' dtype: every element within a small share of the
    larger of the two norms, or of ``total``, the norm of the whole model's batch gradient.

    The second scale is for gradients that are zero but for rounding (the key bias of an
    attention layer, which softmax cancels): their rounding is relative to the terms summed,
    not to the near-zero result. An error below it is below what ``gradscope check`` resolves.
    """
    tol = tolerance(theirs.dtype)
    ours, theirs = ours.double(), theirs.to(ours.device).double()
    own = max(ours.nan_to_num(0).norm().item(), theirs.nan_to_num(0).norm().item())
    atol = max(10 * tol * own, tol * total, 1e-30)
    return torch.allclose(ours, theirs, rtol=0, atol=atol, equal_nan=True)


def agreeing(ours: Tensor, theirs: Tensor) -> list[bool]:
    """Whether each element of ``ours`` is ``theirs``', as ``agrees`` compares one: one read
    for them all."""
    tol = tolerance(theirs.dtype)
    a, b = ours.double(), theirs.to(ours.device).double()
    atol = (10 * tol * torch.maximum(a.nan_to_num(0).abs(), b.nan_to_num(0).abs())).clamp(1e-30)
    return ((a - b).abs() <= atol).logical_or_(a == b).logical_or_(a.isnan() & b.isnan()).tolist()


def first_apart(alone: Tensor, in_batch: Tensor) -> int | None:
    """The first example whose loss run alone is not, up to rounding, its loss in the batch."""
    a, b = alone.double(), in_batch.detach().to(alone.device).double()
    scale = torch.maximum(a.abs(), b.abs()) + b.abs().nan_to_num(0).mean()
    apart = (a - b).abs() > 10 * tolerance(in_batch.dtype) * scale  # NaN on both: not apart
    if not bool(apart.any()):
        return None
    return int(apart.nonzero()[0, 0])


def mixed(i: int, alone: float, in_batch: float, after: str = "") -> ModelError:
    """The refusal of a batch whose example ``i`` has another loss alone than in it."""
    apart = f"example {i}'s loss is {alone:.6g} alone and {in_batch:.6g} in its batch"
    if after == AFTER_BATCH_NORM:  # the model's, not the loss's
        return ModelError(f"{apart}: {BATCH_STATISTICS}", "model")
    return ModelError(
        f"{apart}: the loss (or the model) mixes the examples of a batch{after}, as "
        "l - l.mean() does, so an example has no gradient of its own; reduce each example's "
        "loss alone",
        "loss",
    )


# the refusal's words where a batch norm mixed the examples (``after`` names it so)
AFTER_BATCH_NORM = " (after batch_norm)"
BATCH_STATISTICS = (
    "a batch norm on the batch's own statistics (in training mode, with "
    "track_running_stats=False, or F.batch_norm(training=True)) mixes its examples, so an "
    "example has no gradient of its own; only a batch norm on running statistics (eval mode, "
    "track_running_stats=True) can be scored or watched"
)

# where a number of the batch's values left the trace as a plain one (``tags.Noted``)
PLAIN = " (after a number of the batch's values read on the host)"


def check_alone(
    run, inputs: tuple[Tensor, ...], targets: Tensor, losses: Tensor, every: bool, after: str = ""
) -> None:
    """Each example (``every`` one, else the first and last) run alone by ``run`` (inputs,
    targets -> (losses, ...)) must give its loss in the batch, ``losses``; else the batch is
    refused as mixing its examples."""
    with torch.no_grad():
        for i in range(len(targets)) if every else dict.fromkeys((0, len(targets) - 1)):
            try:
                one_alone(run, inputs, targets, losses, i, lambda *apart: mixed(*apart, after))
            except ModelError as e:
                if e.where == "data.inputs" and len(targets) > 1:  # alone it fails: it mixes
                    why = (
                        BATCH_STATISTICS
                        if after == AFTER_BATCH_NORM
                        else f"the model needs the batch's other examples{after}, or cannot "
                        "take a batch of one, so an example has no gradient of its own"
                    )
                    raise ModelError(
                        f"example {i} alone fails where its batch runs ({e.what}): {why}", "model"
                    ) from e
                raise


def example(inputs: tuple[Tensor, ...], targets: Tensor, i: int) -> tuple[tuple, Tensor]:
    """Example ``i``'s inputs and targets, a batch of one."""
    return tuple(t[i : i + 1] for t in inputs), targets[i : i + 1]


def one_alone(
    run, inputs: tuple[Tensor, ...], targets: Tensor, losses: Tensor, i: int, refusal
) -> None:
    """Example ``i`` run alone by ``run`` must give its loss in the batch; else ``refusal``
    (i, its loss alone, in the batch) is raised."""
    alone = run(*example(inputs, targets, i))[0].reshape(1)
    if not agrees(alone, losses[i : i + 1].detach()):
        raise refusal(i, alone.item(), losses[i].item())


class Singles:
    """The first and last examples' own gradients of ``params``, each from its own backward
    (graph kept), and the norm of each example's whole gradient, the scale its parameters'
    norms are compared at (computed once: a model of many small modules has as many
    parameters to compare)."""

    def __init__(self, losses: Tensor, params: Sequence[Tensor]):
        picked = dict.fromkeys((0, losses.shape[0] - 1))
        with models_backward():
            self.grads = {
                i: list(
                    torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
                )
                for i in picked
            }
        self.scales = {i: _norm(grads) for i, grads in self.grads.items()}

    def agree(self, k: int, norm_sq: Tensor | None, at: torch.dtype | str) -> bool:
        """Whether ``norm_sq`` (B,), the rule's squared norms of parameter ``k``'s per-example
        gradients, matches each single example's own backward, ``close`` at precision ``at``
        with the example's whole gradient as the floor's scale."""
        zero = torch.zeros(1, dtype=torch.float64)
        for i, grads in self.grads.items():
            g = grads[k]
            theirs = zero if g is None else g.double().norm().reshape(1)
            mine = zero if norm_sq is None else norm_sq[i].double().sqrt().reshape(1)
            if not close(mine, theirs, at, total=self.scales[i] or 0.0):
                return False
        return True


def _norm(grads: Sequence[Tensor | None]) -> float | None:
    present = [g.double().norm() for g in grads if g is not None]
    return torch.stack(present).norm().item() if present else None
