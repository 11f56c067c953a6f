"""nn.Conv1d/2d/3d: unfold the input to patches and reuse the Outer (Linear) math, per group."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelError
from .base import Contribution, Dense, Outer, register_rule

_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d


def unfold(module: _Conv, x: Tensor) -> Tensor:
    """(B, G, T, in/G * prod(kernel)) input patches, in the order of ``weight.view(out, -1)``.

    Works for any number of spatial dims (F.unfold is 2-D only) and pads as the module's forward
    does: ``_reversed_padding_repeated_twice`` is what it hands F.pad for non-zero padding modes and
    equals what F.conv's own zero padding (ints, tuples, "same", "valid") amounts to.
    """
    n = len(module.kernel_size)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)  # (B, C, *padded)
    for d, (k, stride, dilation) in enumerate(
        zip(module.kernel_size, module.stride, module.dilation, strict=True)
    ):
        # windows spanning dilation * (k - 1) + 1 inputs, one per output position
        x = x.unfold(2 + d, dilation * (k - 1) + 1, stride)  # (B, C, ..., L_d, ..., span_d)
    # keep every dilation-th input of each window: the ones the kernel touches
    x = x[(..., *(slice(None, None, dilation) for dilation in module.dilation))]  # (B, C, *L, *k)
    b, c, g = x.shape[0], x.shape[1], module.groups
    x = x.reshape(b, g, c // g, *x.shape[2:])  # (B, G, C/G, *L, *k)
    x = x.permute(0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n))  # (B, G, *L, C/G, *k)
    return x.reshape(b, g, math.prod(x.shape[2 : 2 + n]), -1)  # (B, G, T, C/G * prod(k))


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, name="conv")
def conv(module: _Conv, inputs: tuple[Tensor, ...], grad_output: Tensor) -> dict[str, Contribution]:
    n = len(module.kernel_size)
    if inputs[0].dim() != n + 2:
        raise ModelError(
            f"{type(module).__name__} called on an unbatched input of shape "
            f"{tuple(inputs[0].shape)}; per-example gradients need a batch dimension",
            "model",
        )
    b, g = grad_output.shape[0], module.groups
    a = unfold(module, inputs[0])  # (B, G, T, in/G * prod(k))
    s = grad_output.reshape(b, g, module.out_channels // g, -1)  # (B, G, out/G, T)
    s = s.transpose(-1, -2)  # (B, G, T, out/G)
    out: dict[str, Contribution] = {"weight": Outer(s, a, module.weight.shape)}
    if module.bias is not None:
        out["bias"] = Dense(grad_output.flatten(2).sum(2))  # (B, out)
    return out
