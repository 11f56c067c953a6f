"""What an op's arguments say that its name does not, as the trace (``follow.py``, ``lanes/``)
asks: the dims a reduction mixes and whether it keeps them (``dims_of``), ``max(x, y)`` for
elementwise (``binary``), the dims an index picks (``picked_dims``); and owners of one value
shaped for a result (``filled``). The ops the trace knows by name are ``ops.py``'s."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import KEEPS_SHAPE


def dims_of(name: str, args: tuple, kwargs: dict, rank: int) -> tuple[list[int], bool]:
    """(the dims an op of the REDUCTIONS set mixes, whether it keeps them)."""
    dim = kwargs.get("dim", kwargs.get("axis"))  # x.mean(axis=2): numpy's name for it
    if dim is None and len(args) > 1 and not isinstance(args[1], Tensor):
        dim = args[1]
    if name == "normalize":
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
    if name == "topk":
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    if name == "norm" and len(args) > 1:  # norm(x, p, dim)
        dim = kwargs.get("dim", kwargs.get("axis", args[2] if len(args) > 2 else None))
    if name in ("std", "var") and len(args) > 1 and isinstance(args[1], bool):  # (x, unbiased)
        dim = kwargs.get("dim", kwargs.get("axis"))
    keep = name in KEEPS_SHAPE or bool(kwargs.get("keepdim", False))
    if not keep and len(args) > 2 and isinstance(args[2], bool):
        keep = args[2]
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(rank)), keep
    return ([dim] if isinstance(dim, int) else list(dim)), keep


def binary(name: str, args: tuple, kwargs: dict) -> bool:
    """torch.max(x, y) and min: elementwise, not a reduction."""
    return name in ("max", "min") and (
        "other" in kwargs or (len(args) > 1 and isinstance(args[1], Tensor))
    )


def filled(t: Tensor, value: int) -> Tensor:
    """Owners ``value`` for every element of ``t``: (1, ..., 1) of its rank, on its device."""
    return torch.full((1,) * t.dim(), value, dtype=torch.long, device=t.device)


def picked_dims(key: object, pickers: list[Tensor], rank: int) -> list[int]:
    """The dimensions of a tensor of ``rank`` that ``x[key]`` indexes with one of ``pickers``
    (a bool mask of rank r indexes r dimensions; ``None`` none; ``...`` the rest)."""
    key = key if isinstance(key, tuple) else (key,)

    def width(k: object) -> int:
        if k is None or k is Ellipsis:
            return 0
        if isinstance(k, Tensor) and k.dtype == torch.bool:
            return k.dim()
        return 1

    rest = rank - sum(width(k) for k in key)
    dims, at = [], 0
    for k in key:
        span = rest if k is Ellipsis else width(k)
        if any(k is t for t in pickers):
            dims.extend(range(at, at + span))
        at += span
    return dims
