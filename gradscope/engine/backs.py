"""Batched vector-Jacobian products written out for the few ops a tensor computed from
parameters is commonly made by (``derived.py``'s ``Computed``): a weight standardisation
(BiT's ``WeightStandardizedConv2d``, timm's ``StdConv2d``: ``F.batch_norm(W.reshape(1, O, -1),
None, None, training=True).reshape_as(W)``) and the reshapes around it. Each carries the B
examples' gradients of the op's output back to its first argument in a few batched tensor ops,
where ``torch.func``'s vjp under vmap pays its transforms' Python on every call (265 us against
48 for a 16x8x3x3 weight at batch 4). Any other op, or these with other arguments, has none:
the computed tensor is carried back by ``torch.func`` as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rules.standardised import standardised_back
from .ops import op_name

Back = Callable[[Tensor], Tensor]  # (B, *output's shape) -> (B, *first argument's shape)

# ops whose output is their first argument's elements in the same order, in another shape
_RESHAPES = {"reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous"}
_SHAPED_AS = {"reshape_as", "view_as"}  # the second argument gives the shape alone


def back_of(func: Callable, args: tuple, kwargs: dict) -> Back | None:
    """The batched VJP of ``func(*args, **kwargs)`` to ``args[0]``, the one argument a gradient
    reaches (another tensor among them gives its shape alone), or None where not written out."""
    if not args or not isinstance(args[0], Tensor):
        return None
    x, name = args[0], op_name(func)
    if name in _RESHAPES | _SHAPED_AS:
        rest = (*args[1:], *kwargs.values())
        tensors = [a for a in rest if isinstance(a, Tensor)]
        if any(isinstance(a, torch.dtype) for a in rest) or len(tensors) > (name in _SHAPED_AS):
            return None  # ``view(dtype)`` reinterprets, not reshapes
        shape = x.shape
        return lambda grads: grads.reshape(grads.shape[0], *shape)
    if func is F.batch_norm:
        return _standardised(x, args, kwargs)
    return None


def _standardised(x: Tensor, args: tuple, kwargs: dict) -> Back | None:
    """``F.batch_norm`` of ``x`` by its own statistics, with no running ones and no affine:
    each channel (dimension 1) ``(x - mean) / sqrt(var + eps)`` over every other dimension
    (``rules/standardised.py``'s math, which a standardised convolution's rule shares)."""
    names = (
        "input",
        "running_mean",
        "running_var",
        "weight",
        "bias",
        "training",
        "momentum",
        "eps",
    )
    given = dict(zip(names, args, strict=False)) | kwargs
    unused = ("running_mean", "running_var", "weight", "bias")
    if not given.get("training", False) or any(given.get(k) is not None for k in unused):
        return None
    eps = given.get("eps", 1e-5)
    return standardised_back(x, [d for d in range(x.dim()) if d != 1], eps)
