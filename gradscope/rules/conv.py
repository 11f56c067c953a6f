"""nn.Conv1d/2d/3d: unfold the input to patches and reuse the Outer (Linear) math, per group."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelError
from . import base
from .base import Contribution, Dense, _acc
from .formed import Formed
from .outer import Outer
from .registry import register_rule

_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d

# Elements that forming a convolution's per-example gradients may hold beyond its input and
# output gradient (256 KiB in float64): the batch's gradients count the weight once per example,
# so without them no batch would fit one chunk, and a second convolution backward costs a pass
# more than the memory it saves where the weight is small (ResNet's, at batch 3: 1.1 ms of 5.7;
# T4's first layer, whose peak stays within the floor's, its second one still formed in two).
FORMED_BESIDE = 1 << 15


def unfold(module: _Conv, x: Tensor) -> Tensor:
    """(B, G, T, in/G * prod(kernel)) input patches, in the order of ``weight.view(out, -1)``.

    Works for any number of spatial dims (F.unfold is 2-D only) and pads as the module's forward
    does: ``_reversed_padding_repeated_twice`` is what it hands F.pad for non-zero padding modes and
    equals what F.conv's own zero padding (ints, tuples, "same", "valid") amounts to.
    """
    n, pads = len(module.kernel_size), module._reversed_padding_repeated_twice
    b, c, g = x.shape[0], x.shape[1], module.groups
    if _one_unfold(module):
        if module.kernel_size == (1, 1) and not any(pads):  # the strided input itself: a view
            cols = x[:, :, :: module.stride[0], :: module.stride[1]].reshape(b, c, -1)
        else:  # im2col, one op: (B, C * prod(k), T), each channel's kernel positions in turn
            cols = F.unfold(x, module.kernel_size, module.dilation, pads[0::2][::-1], module.stride)
        return cols.view(b, g, -1, cols.shape[-1]).transpose(-1, -2)  # (B, G, T, C/G * prod(k))
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, pads, mode=mode)  # (B, C, *padded)
    for d, (k, stride, dilation) in enumerate(
        zip(module.kernel_size, module.stride, module.dilation, strict=True)
    ):
        # windows spanning dilation * (k - 1) + 1 inputs, one per output position
        x = x.unfold(2 + d, dilation * (k - 1) + 1, stride)  # (B, C, ..., L_d, ..., span_d)
    # keep every dilation-th input of each window: the ones the kernel touches
    x = x[(..., *(slice(None, None, dilation) for dilation in module.dilation))]  # (B, C, *L, *k)
    x = x.reshape(b, g, c // g, *x.shape[2:])  # (B, G, C/G, *L, *k)
    x = x.permute(0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n))  # (B, G, *L, C/G, *k)
    return x.reshape(b, g, math.prod(x.shape[2 : 2 + n]), -1)  # (B, G, T, C/G * prod(k))


@contextlib.contextmanager
def _full_float32() -> Iterator[None]:
    """cuDNN without TF32, which it takes for float32 convolutions unless told not to: a sum of
    products rounded to 10 bits, which one example's weight gradient (a sum over its positions,
    whose terms cancel) turns into errors of 1e-2 where the loop's own gradients are exact to
    1e-7. The model's own convolutions run as the user set them."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def per_example_weight_grads(module: _Conv, x: Tensor, grad_output: Tensor) -> Tensor:
    """(B, *weight.shape): each example's weight gradient, from ONE convolution backward with the
    examples folded into the groups, so no patch matrix is formed."""
    b, n = x.shape[0], len(module.kernel_size)
    pads = list(module._reversed_padding_repeated_twice)  # (left, right) per dim, last dim first
    if module.padding_mode == "zeros" and pads[0::2] == pads[1::2]:
        padding = pads[0::2][::-1]  # the convolution pads as forward does: no padded copy of x
    else:  # other modes, or "same" padding uneven on two sides
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x, padding = F.pad(x, pads, mode=mode), [0] * n
    # contiguous first: a channels-last tensor (Swin2SR's, transposed from tokens) reshaped
    # as it lies makes a copy the convolution backward reads slower than its own
    x = _acc(x).contiguous().view(1, -1, *x.shape[2:])  # (1, B*C, *in): example i is groups iG..
    s = _acc(grad_output).contiguous().view(1, -1, *grad_output.shape[2:])  # (1, B*out, *L)
    # the weight's values only reach the input gradient, which is not asked for: a zero will do
    with _full_float32() if x.is_cuda else contextlib.nullcontext():
        _, grads, _ = torch.ops.aten.convolution_backward(
            s,
            x,
            x.new_zeros(()).expand(b * module.out_channels, *module.weight.shape[1:]),
            None,
            module.stride,
            padding,
            module.dilation,
            False,
            [0] * n,
            b * module.groups,
            [False, True, False],
        )
    return grads.view(b, *module.weight.shape)  # (B*out, in/G, *k) -> (B, out, in/G, *k)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d, name="conv")
def conv(module: _Conv, inputs: tuple[Tensor, ...], grad_output: Tensor) -> dict[str, Contribution]:
    _batched(module, inputs[0])
    out = {"weight": weight_part(module, inputs[0], grad_output)}
    if module.bias is not None:
        out["bias"] = Dense(grad_output.flatten(2).sum(2))  # (B, out)
    return out


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, name="conv_transpose")
def conv_transpose(
    module: nn.modules.conv._ConvTransposeNd,
    inputs: tuple[Tensor, ...],
    grad_output: Tensor,
    output_size: object = None,
) -> dict[str, Contribution]:
    """A transposed convolution is the adjoint of the convolution with the same weight, stride,
    padding, dilation and groups (its input gradient): its weight gradient is that convolution's,
    with the output gradient as the input and the input as the output gradient."""
    _batched(module, inputs[0])
    out = {"weight": weight_part(_Adjoint(module), grad_output, inputs[0])}
    if module.bias is not None:
        out["bias"] = Dense(grad_output.flatten(2).sum(2))  # (B, out)
    return out


class _Adjoint:
    """The convolution whose adjoint ``module`` computes, as far as ``weight_part`` reads it."""

    def __init__(self, module: nn.modules.conv._ConvTransposeNd):
        self.weight, self.groups, self.padding_mode = module.weight, module.groups, "zeros"
        self.kernel_size, self.stride, self.dilation = (
            module.kernel_size, module.stride, module.dilation,
        )  # fmt: skip
        self.out_channels = module.in_channels  # the adjoint maps the output's channels back
        self._reversed_padding_repeated_twice = [p for p in reversed(module.padding) for _ in "ab"]


def _batched(module: nn.Module, x: Tensor) -> None:
    if x.dim() != len(module.kernel_size) + 2:
        raise ModelError(
            f"{type(module).__name__} called on an unbatched input of shape "
            f"{tuple(x.shape)}; per-example gradients need a batch dimension",
            "model",
        )


def weight_part(module: _Conv | _Adjoint, x: Tensor, grad_output: Tensor) -> Contribution:
    """The weight's contribution of a convolution from its input and output gradient."""
    b, g = grad_output.shape[0], module.groups
    t = math.prod(grad_output.shape[2:])
    i, o = module.weight.shape[1:].numel(), module.out_channels // g  # in/G * prod(k), out/G
    if t * (i + o) < i * o:  # few positions: the Gram of the patches, no per-example gradient
        a = unfold(module, x)  # (B, G, T, in/G * prod(k))
        s = grad_output.reshape(b, g, o, t).transpose(-1, -2)  # (B, G, T, out/G)
        return Outer(s, a, module.weight.shape)
    # forming the gradients costs less: a few examples at a time where the batch's gradients,
    # and the copies of its input and output gradient the backward makes, would pass the bound
    # on one temporary, or what the input and the output gradient themselves hold (the plain
    # backward's own peak holds those) and FORMED_BESIDE more: in even chunks, the fewest that
    # keep under it
    per_example = (x.numel() + grad_output.numel()) // b + module.weight.numel()
    bound = min(base.CHUNK_ELEMENTS, x.numel() + grad_output.numel() + FORMED_BESIDE)
    step = max(1, bound // per_example)
    step = -(-b // -(-b // step))  # b examples in ceil(b / step) chunks, as even as they go
    if _patches_at_hand(module, b * g * t * i):
        # patches that cost a view or one im2col: each example's G by one product, where the
        # convolution backward's Python and copies cost more than its work (small layers)
        a = _acc(unfold(module, x))  # (B, G, T, in/G * prod(k))
        s = _acc(grad_output).reshape(b, g, o, t)  # (B, G, out/G, T)

        def form(lo: int, hi: int) -> Tensor:  # (b, G, O, T) @ (b, G, T, I) -> (b, *W's shape)
            return (s[lo:hi] @ a[lo:hi]).view(hi - lo, *module.weight.shape)

    else:  # the convolution backward, which forms them fastest with no patch matrix

        def form(lo: int, hi: int) -> Tensor:
            return per_example_weight_grads(module, x[lo:hi], grad_output[lo:hi])

    if step >= b:
        return Dense(form(0, b))
    return Formed(form, b, module.weight.shape, step)


def _patches_at_hand(module: _Conv | _Adjoint, elements: int) -> bool:
    """Whether a 2-D convolution's patches (``elements`` of them) are its input itself, a
    1x1 kernel's without padding (strided, a view), or no more than ``FORMED_BESIDE`` elements
    (nor the bound on one temporary) laid out by one im2col (``unfold``)."""
    if not _one_unfold(module):
        return False
    pads = module._reversed_padding_repeated_twice
    bound = min(FORMED_BESIDE, base.CHUNK_ELEMENTS)
    return module.kernel_size == (1, 1) and not any(pads) or elements <= bound


def _one_unfold(module: _Conv | _Adjoint) -> bool:
    """Whether a convolution's patches are one ``F.unfold`` (or, 1x1 unpadded, a strided view):
    2-D, padded with zeros (or not at all), as much on each side."""
    pads = module._reversed_padding_repeated_twice
    zeros = module.padding_mode == "zeros" or not any(pads)
    return len(module.kernel_size) == 2 and zeros and pads[0::2] == pads[1::2]
