"""nn.Linear on inputs of any rank: (B, in), (B, T, in), (B, ..., in)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .base import Contribution, Dense, Once, _acc
from .outer import Outer
from .registry import register_rule
from .trailing import trailing


def affine_parts(
    x: Tensor,
    grad_output: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    transposed: bool = False,
    lengths: Sequence[int] | None = None,
) -> dict[str, Contribution]:
    """Weight and bias contributions of ``y = x W^T + b`` (``y = x W + b`` when ``transposed``).

    ``x`` is (B, ..., in) and ``grad_output`` (B, ..., out); the weight is (out, in), or (in, out)
    when transposed: the same outer products with the roles of inputs and output gradients swapped.
    ``lengths``: example i's rows are its first ``lengths[i]`` of (B, T, ...), the rest zeros;
    where none are given, the rows of zero output gradients at each example's end are cut
    (``trailing.py``).
    """
    b = grad_output.shape[0]
    a = x.reshape(b, 1, -1, x.shape[-1])  # (B, 1, T, in)
    s = grad_output.reshape(b, 1, -1, grad_output.shape[-1])  # (B, 1, T, out)
    # one position: the output gradient is the bias gradient (summing size-1 dims still
    # copies, and indexing it out costs two ops more than taking it as it came), and its
    # squared norm both the bias's and a factor of the weight's: computed once for both
    one = None
    if s.shape[2] == 1:
        one = _acc(grad_output if grad_output.dim() == 2 else s[:, 0, 0])  # (B, out)
    sq = Once(one) if one is not None and bias is not None and not transposed else None
    shape, trimmed = weight.shape, False
    if lengths is None and (cut := trailing(s, a)) is not None:
        lengths, trimmed = cut, True
    weights = (a, s) if transposed else (s, a)
    out = {"weight": Outer(*weights, shape, lengths, sq, trimmed)}
    if bias is not None:
        out["bias"] = Dense(s.sum((1, 2)) if one is None else one, sq)
    return out


def shaped(module: nn.Module) -> tuple:
    """A Linear-like module as ``affine_parts`` reads it: its weight's shape, whether it has a
    bias (``Rule.alike``)."""
    return module.weight.shape, module.bias is None


@register_rule(nn.Linear, name="linear", rows=lambda module: 1, alike=shaped)
def linear(
    module: nn.Linear, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    return affine_parts(inputs[0], grad_output, module.weight, module.bias)
