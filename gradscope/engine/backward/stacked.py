"""Reference directions laid out stacked once, so the passes that answer several parameters'
inner products together read their references as one tensor without copying them: the
references of alike layers (a transformer's 12 ``c_attn`` weights, a Mixtral's routed experts)
stacked for each pass would copy as many bytes as those layers' parameters hold."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from ...rules.base import accumulation_dtype


def laid_out(params: Sequence[Tensor]) -> list[Tensor]:
    """(1, *shape) zeros in the accumulation dtype for each of ``params``; those of one shape, dtype
    and device are rows of one tensor, the last parameter first, in the order the backward reaches
    alike layers, where ``rules.base.stacked`` reads them as one. A parameter of another tensor type
    (a sharded one) gets a tensor of its own, of its type."""
    out: list[Tensor | None] = [None] * len(params)
    alike: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if type(p) in (Tensor, Parameter):
            alike.setdefault((p.shape, accumulation_dtype(p.dtype), p.device), []).append(i)
        else:
            out[i] = torch.zeros_like(p, dtype=accumulation_dtype(p.dtype)).unsqueeze(0)
    for (shape, dtype, device), at in alike.items():
        block = torch.zeros(len(at), 1, *shape, dtype=dtype, device=device)  # (n, 1, *shape)
        for row, i in zip(block, reversed(at), strict=True):
            out[i] = row
    return out
