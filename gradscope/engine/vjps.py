"""A computed tensor's per-example gradients carried back to its sources (``derived.Computed``):
one vector-Jacobian product for the batch, by the faster of two exact ways for its kind.

- autograd's own backward with ``is_grads_batched``: no per-op cost of ``torch.func``'s
  transforms, so about half the time on small tables (a weight-norm weight: 0.15 ms against
  0.31 at batch 3; SEW-D's relative embeddings normed and projected: 2.2 ms against 3.0);
- ``torch.func``'s vjp under ``vmap``, whose batching rules take some kernels another way
  (RADIO's 256 x 256 position table interpolated to the patches: 8.7 ms against 69).

Which is faster is a matter of kernels, not of shapes alone, so each kind of tensor (``kind``:
the ops that make it from its leaves, the shapes, the gradients' shape) is timed both ways on
its first gradients, on the CPU, and the faster kept for the process. Elsewhere (a device whose
kernels run apart from the host, which timing would wait for) the vmap's, as before.

Several tensors made from the same leaves (a rotary table's cos and sin, made again in each
layer: MLCD's four at two layers) go back as one: ``func`` gives them as a tuple, ``grads`` is
the tuple of their gradients, and one backward sums their VJPs, where one each paid the
transforms' fixed cost (0.35 ms each at batch 3) four times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# (B, *shape) gradients of one tensor, or a tuple of them, one for each tensor ``func`` gives
Grads = Tensor | tuple[Tensor, ...]
Back = Callable[[Callable[..., Tensor], Sequence[Tensor], Grads], tuple[Tensor, ...]]


def by_vmap(func: Callable[..., Tensor], values: Sequence[Tensor], grads: Grads):
    """(B, *shape) gradients of ``func(*values)`` -> (B, *value shape) per value."""
    value, vjp = torch.func.vjp(func, *values)
    grads = _cast(grads, value)
    try:
        return torch.func.vmap(vjp)(grads)
    except Exception:  # an op without a batching rule (vmap's message varies): one at a time
        return _stacked([vjp(g) for g in _examples(grads)])


def by_autograd(func: Callable[..., Tensor], values: Sequence[Tensor], grads: Grads):
    """As ``by_vmap``, by autograd's batched backward of ``func`` run again on ``values``."""
    leaves = [v.detach().requires_grad_() for v in values]
    with torch.enable_grad():
        value = func(*leaves)
    grads = _cast(grads, value)

    def vjp(g: Tensor, batched: bool = False) -> tuple[Tensor, ...]:
        return torch.autograd.grad(
            value, leaves, g, retain_graph=True, materialize_grads=True, is_grads_batched=batched
        )

    try:
        return vjp(grads, batched=True)
    except Exception:  # an op without a batching rule, as above
        return _stacked([vjp(g) for g in _examples(grads)])


def _cast(grads: Grads, value: Tensor | tuple[Tensor, ...]) -> Grads:
    """``grads`` in the dtype of the tensor (or of each tensor) they are the gradients of."""
    if isinstance(grads, tuple):
        return tuple(g.to(v.dtype) for g, v in zip(grads, value, strict=True))
    return grads.to(value.dtype)


def _examples(grads: Grads) -> list:
    """Each example's gradient (of each tensor, where several)."""
    return list(zip(*grads, strict=True)) if isinstance(grads, tuple) else list(grads)


def _stacked(per: list[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    return tuple(torch.stack(gs) for gs in zip(*per, strict=True))


def _shape(grads: Grads) -> tuple:
    if isinstance(grads, tuple):
        return tuple(tuple(g.shape) for g in grads), grads[0].dtype
    return tuple(grads.shape), grads.dtype


WAYS: tuple[Back, ...] = (by_autograd, by_vmap)
_FASTER: dict[tuple, Back] = {}  # by kind: the way found faster


def back(kind: tuple, func: Callable[..., Tensor], values: Sequence[Tensor], grads: Grads):
    """``func``'s VJP of each example's gradients (B, *shape; a tuple where ``func`` gives
    several tensors, their VJPs summed), by the way faster for ``kind`` (each timed twice,
    alternating, on its first gradients)."""
    first = grads[0] if isinstance(grads, tuple) else grads
    if first.device.type != "cpu":
        return by_vmap(func, values, grads)
    key = (kind, *_shape(grads))
    way = _FASTER.get(key)
    if way is not None:
        return way(func, values, grads)
    spent = dict.fromkeys(WAYS, float("inf"))
    for _ in range(2):
        for way in WAYS:
            start = time.process_time()
            out = way(func, values, grads)
            spent[way] = min(spent[way], time.process_time() - start)
    _FASTER[key] = min(WAYS, key=spent.__getitem__)
    return out
