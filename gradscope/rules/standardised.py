"""Layers whose forward normalises before it reads, from transformers' BiT, recognised by
qualified name, never imported: ``WeightStandardizedConv2d``, a convolution of its weight
standardised per output channel, and ``BitGroupNormActivation``, a group norm then an
activation. Served by their own calls' rules, so that no op inside them is intercepted.

A standardised convolution's per-example gradient is the convolution's at the standardised
weight (``conv.weight_part``), carried back to the parameter by the standardisation's VJP,
example by example (``standardised_back``); the group norm's is the group norm rule's, at the
output gradient carried back through the activation first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Contribution, Dense
from .conv import _batched, weight_part
from .formed import Formed
from .norm import group_norm
from .registry import register_rule

BIT = "transformers.models.bit.modeling_bit"


def standardised_back(x: Tensor, dims: list[int], eps: float) -> Callable[[Tensor], Tensor]:
    """(B, *x's shape) gradients at ``(x - mean) / sqrt(var + eps)``, the statistics over
    ``dims`` of ``x`` (biased variance, as ``F.batch_norm`` of its own batch takes it) -> (B,
    *x's shape) gradients at ``x``: ``rstd (g - mean(g) - xhat mean(g xhat))``, the means per
    example over the same dims. The statistics are formed when it is called, in the backward,
    where no function mode of the forward sees them."""
    below = [d + 1 for d in dims]  # the same dimensions of (B, *x's shape)

    def back(grads: Tensor) -> Tensor:
        var, mean = torch.var_mean(x.detach(), dims, correction=0, keepdim=True)
        rstd = var.add_(eps).rsqrt_()
        xhat = (x.detach() - mean).mul_(rstd)  # (*x's shape)
        mean_g = grads.mean(below, keepdim=True)
        mean_gx = (grads * xhat).mean(below, keepdim=True)
        return (grads - mean_g).sub_(xhat * mean_gx).mul_(rstd)

    return back


@register_rule(name="standardised_conv", qualnames=(f"{BIT}.WeightStandardizedConv2d",))
def standardised_conv(
    module: nn.Conv2d, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    """``F.conv2d(pad(x), standardised(W), b, ...)``, W standardised per output channel with
    the module's ``eps``, ``pad`` its dynamic "SAME" padding where it has one."""
    x, w, b = inputs[0], module.weight, grad_output.shape[0]
    _batched(module, x)
    if getattr(module, "pad", None) is not None:
        # as the forward pads, before its convolution's own padding; its forward, not the
        # call: no module hook (the engine's own) sees a call made in the backward
        x = module.pad.forward(x)
    at = weight_part(module, x, grad_output)  # at the standardised weight
    back = standardised_back(w.reshape(w.shape[0], -1), [1], module.eps)  # per output channel

    def carried(part: Contribution) -> Tensor:
        grads = part.materialize()  # (b, *W's shape)
        return back(grads.reshape(grads.shape[0], w.shape[0], -1)).view(grads.shape)

    if isinstance(at, Formed):  # a few examples at a time, as the convolution's own
        out = {"weight": Formed(lambda lo, hi: carried(at.examples(lo, hi)), b, w.shape, at.step)}
    else:
        out = {"weight": Dense(carried(at))}
    if module.bias is not None:
        out["bias"] = Dense(grad_output.flatten(2).sum(2))  # (B, out)
    return out


@register_rule(name="group_norm_activation", qualnames=(f"{BIT}.BitGroupNormActivation",))
def group_norm_activation(
    module: nn.GroupNorm, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    """``activation(F.group_norm(x, groups, weight, bias, eps))``: the output gradient carried
    back through the activation at the group norm's output, made again as the forward made it,
    then the group norm rule's parts."""
    x = inputs[0]
    normed = F.group_norm(x, module.num_groups, module.weight, module.bias, module.eps)
    return group_norm(module, inputs, _through(module.activation, normed.detach(), grad_output))


def _through(activation: nn.Module, at: Tensor, grad: Tensor) -> Tensor:
    """``grad`` at ``activation(at)`` carried back to ``at``: as it is for the identity, by
    ReLU's own backward for ReLU, by autograd for any other."""
    if type(activation) is nn.Identity:
        return grad
    if type(activation) is nn.ReLU:
        return torch.ops.aten.threshold_backward(grad, at, 0)
    with torch.enable_grad():
        at.requires_grad_()
        return torch.autograd.grad(activation(at), at, grad)[0]
