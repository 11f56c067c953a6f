"""Index keys (``x[key]``, ``x[key] = y``): which dimensions of the indexed tensor each entry
of a key takes, as torch reads them (an ellipsis the ones no other entry takes, a boolean mask
as many as it has, None and a Python bool none)."""

from __future__ import annotations

import torch
from torch import Tensor


def span(k: object, n: int, key: tuple) -> int:
    """The dimensions of a result that ``k``, one entry of an index ``key`` into a tensor of
    ``n`` dimensions, gives: an ellipsis the ones no other entry takes."""
    if k is Ellipsis:
        return n - sum(takes(j) for j in key)
    return 1  # None, a slice


def takes(k: object) -> int:
    """The dimensions of the indexed tensor that ``k`` takes."""
    if isinstance(k, Tensor) and k.dtype == torch.bool:
        return k.dim()
    return 0 if k is None or k is Ellipsis or isinstance(k, bool) else 1


def starts(key: tuple, n: int):
    """Each entry of an index ``key`` into a tensor of ``n`` dimensions, with its position in
    the key and the first dimension of the tensor it covers: (i, entry, dimension)."""
    rest = n - sum(takes(j) for j in key)  # what an ellipsis covers
    at = 0
    for i, k in enumerate(key):
        yield i, k, at
        at += rest if k is Ellipsis else takes(k)


def taken(key: tuple, n: int, spots: list[int]) -> list[int]:
    """The dimensions of a tensor of ``n`` dimensions that the entries ``spots`` of an index
    ``key`` take."""
    return [at for i, _, at in starts(key, n) if i in spots]


def masks(key: object, n: int) -> list[tuple[int, Tensor]]:
    """The boolean tensors of an index ``key`` into a tensor of ``n`` dimensions, each with the
    first dimension it covers."""
    key = key if isinstance(key, tuple) else (key,)
    return [
        (at, k) for _, k, at in starts(key, n) if isinstance(k, Tensor) and k.dtype == torch.bool
    ]
