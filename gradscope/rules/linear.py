"""nn.Linear on inputs of any rank: (B, in), (B, T, in), (B, ..., in)."""

from __future__ import annotations

from torch import Tensor, nn

from .base import Contribution, Dense, Outer, register_rule


@register_rule(nn.Linear, name="linear")
def linear(
    module: nn.Linear, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    b = grad_output.shape[0]
    a = inputs[0].reshape(b, 1, -1, module.in_features)  # (B, 1, T, in)
    s = grad_output.reshape(b, 1, -1, module.out_features)  # (B, 1, T, out)
    out = {"weight": Outer(s, a, module.weight.shape)}
    if module.bias is not None:
        # one position: the output gradient is the bias gradient (summing size-1 dims still copies)
        out["bias"] = Dense(s[:, 0, 0] if s.shape[2] == 1 else s.sum((1, 2)))  # (B, out)
    return out
