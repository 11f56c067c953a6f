"""LayerNorm, RMSNorm, GroupNorm, BatchNorm and InstanceNorm in eval mode: grads formed directly.

Each rule recomputes xhat from the captured input with the module's own functional and its eps,
as the module's forward does (LayerNorm's on the CPU from its statistics, which cost less than
the CPU's ``layer_norm`` kernel), then weight grad = sum over positions of s * xhat, bias = sum of s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelError
from .base import Contribution, Dense, _acc
from .registry import register_rule


def affine(
    module: nn.Module,
    xhat: Tensor,
    s: Tensor,
    reduce: Callable[[Tensor], Tensor],
    own: bool = False,
) -> dict[str, Contribution]:
    """Dense weight and bias contributions, for whichever of the two the module has. ``own``:
    ``xhat`` is the rule's to overwrite (a functional's result), and ``s * xhat`` is formed in
    it, not beside it: a stacked group's (n*B, T, d) less at its answer's peak."""
    s = _acc(s)
    out: dict[str, Contribution] = {}
    if module.weight is not None:
        xhat = _acc(xhat)
        if own and (xhat.shape, xhat.stride(), xhat.dtype) == (s.shape, s.stride(), s.dtype):
            out["weight"] = Dense(reduce(xhat.mul_(s)))
        else:
            out["weight"] = Dense(reduce(s * xhat))
    if getattr(module, "bias", None) is not None:
        out["bias"] = Dense(reduce(s))
    return out


def per_channel(t: Tensor) -> Tensor:
    """(B, C, *spatial) -> (B, C) for parameters of one value per channel; spatial may be ()."""
    return t.reshape(*t.shape[:2], -1).sum(2)


def normalized(module: nn.Module) -> tuple:
    """A LayerNorm or RMSNorm as its rule reads it (``Rule.alike``)."""
    bias = getattr(module, "bias", None)
    return module.normalized_shape, module.eps, module.weight is None, bias is None


@register_rule(
    nn.LayerNorm,
    name="layer_norm",
    rows=lambda module: len(module.normalized_shape),
    alike=normalized,
)
def layer_norm(
    module: nn.LayerNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    x, shape, b = inputs[0], module.normalized_shape, grad_output.shape[0]
    # on an accelerator the fused kernel is one read and write of x, its parts three of each
    xhat = centred(x, shape, module.eps) if x.is_cpu else F.layer_norm(x, shape, eps=module.eps)
    return affine(module, xhat, grad_output, lambda t: t.reshape(b, -1, *shape).sum(1), True)


def centred(x: Tensor, shape: tuple[int, ...], eps: float) -> Tensor:
    """(..., *shape) ``F.layer_norm(x, shape, eps=eps)`` without affine, in the accumulation
    dtype, fresh: the mean, the centred input, its sum of squares and a scale, each a simple
    kernel, which together cost half the CPU's ``layer_norm`` (its rows' moments are slow)."""
    x, dims = _acc(x), tuple(range(-len(shape), 0))
    xhat = x - x.mean(dims, keepdim=True)  # (..., *shape)
    ss = torch.linalg.vector_norm(xhat, dim=dims, keepdim=True).square_()  # (..., 1, ..., 1)
    return xhat.mul_(ss.div_(math.prod(shape)).add_(eps).rsqrt_())


@register_rule(
    nn.RMSNorm, name="rms_norm", rows=lambda module: len(module.normalized_shape), alike=normalized
)
def rms_norm(
    module: nn.RMSNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    shape, b = module.normalized_shape, grad_output.shape[0]
    xhat = F.rms_norm(inputs[0], shape, None, module.eps)
    return affine(module, xhat, grad_output, lambda t: t.reshape(b, -1, *shape).sum(1), True)


@register_rule(nn.GroupNorm, name="group_norm")
def group_norm(
    module: nn.GroupNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    xhat = F.group_norm(inputs[0], module.num_groups, None, None, module.eps)
    return affine(module, xhat, grad_output, per_channel, True)


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, name="batch_norm")
def batch_norm(
    module: nn.modules.batchnorm._BatchNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    if module.training or module.running_mean is None or module.running_var is None:
        # the forward then normalizes with the batch's own statistics (training mode, or eval
        # without running stats): each example's output, so its gradient, depends on the others
        raise ModelError(
            f"{type(module).__name__} normalizes with batch statistics "
            + ("(training mode)" if module.training else "(track_running_stats=False)")
            + ", which couples the examples of a batch: per-example gradients are not defined",
            "model",
        )
    xhat = F.batch_norm(
        inputs[0], module.running_mean, module.running_var, None, None, False, 0.0, module.eps
    )
    return affine(module, xhat, grad_output, per_channel, True)


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, name="instance_norm")
def instance_norm(
    module: nn.modules.instancenorm._InstanceNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    # each example's own statistics unless eval mode tracks running ones; either way examples stay
    # independent. Running stats are passed only when used, so nothing here updates them.
    own_stats = module.training or not module.track_running_stats
    mean, var = (None, None) if own_stats else (module.running_mean, module.running_var)
    xhat = F.instance_norm(inputs[0], mean, var, None, None, own_stats, 0.0, module.eps)
    return affine(module, xhat, grad_output, per_channel, True)
