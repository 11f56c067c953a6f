"""The arguments of the functional calls the tap serves, bound by name as the functions take them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...rules import Contribution, Dense
from ...rules.conv import weight_part

GROUPED = {"grouped_mm", "_grouped_mm", "grouped_mm_fallback"}  # torch's, transformers'
CONVS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}


@dataclass
class ConvCall:
    """``F.conv{n}d(x, weight, bias, stride, padding, dilation, groups)`` with the attributes of
    the module that would make it (what ``rules.conv.weight_part`` reads)."""

    weight: Tensor
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    _reversed_padding_repeated_twice: list[int]
    padding_mode: str = "zeros"

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0]


def bind_conv(
    name: str, args: tuple, kwargs: dict
) -> tuple[Tensor, Tensor, Tensor | None, ConvCall]:
    """(input, weight, bias, the call) of an ``F.conv{n}d`` call."""
    n = CONVS[name]
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = (None, None, None, 1, 0, 1, 1)
    given = dict(zip(names, args, strict=False)) | kwargs
    x, weight, bias, stride, padding, dilation, groups = (
        given.get(k, d) for k, d in zip(names, defaults, strict=True)
    )

    def dims(v: object) -> tuple[int, ...]:
        return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * n

    kernel, dilation = tuple(weight.shape[2:]), dims(dilation)
    if padding == "same":  # as nn.Conv pads: the odd one on the right
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)][::-1]
        pads = [p for t in totals for p in (t // 2, t - t // 2)]
    else:
        pads = [p for p in dims(0 if padding == "valid" else padding)[::-1] for _ in "lr"]
    call = ConvCall(weight, kernel, dims(stride), dilation, int(groups), pads)
    return x, weight, bias, call


def conv_parts(call: ConvCall, x: Tensor, grad: Tensor, bias: bool) -> dict[str, Contribution]:
    """The weight's (and bias's) per-example contributions of a convolution call."""
    out = {"weight": weight_part(call, x, grad)}
    if bias:
        out["bias"] = Dense(grad.flatten(2).sum(2))
    return out


def einsum_terms(equation: object, operands: tuple) -> tuple | None:
    """((operand, its indices), (operand, its indices), the output's indices) of a two-operand
    einsum; None for other equations (an ellipsis, an implicit output, a repeated index)."""
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
        return None
    equation = equation.replace(" ", "")
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if "." in equation or len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    if not all(
        isinstance(t, Tensor) and t.dim() == len(s) for t, s in zip(operands, terms, strict=True)
    ):
        return None
    return (operands[0], terms[0]), (operands[1], terms[1]), out
