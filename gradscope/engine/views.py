"""Views of a parameter and where they sit in it: ``W[e]``, chunks, slices, ``W.T``, casts,
``1 + w``, scalar multiples, each as a ``Place`` the tap hands to ``Placed``."""

from __future__ import annotations

from torch import Tensor

from ..rules.placed import Place
from .ops import CASTS, SCALES, SHIFTS


def places(name: str, place: Place, args: tuple, kwargs: dict, param: Tensor, out) -> list | None:
    """The place of each output of a view, cast or scale of a tensor at ``place``; None when
    it cannot be placed."""
    if name in CASTS:
        dtype = getattr(out, "dtype", None)
        return None if dtype is None or not dtype.is_floating_point else [place]
    if name in SHIFTS | SCALES:
        c = next((a for a in args[1:] if isinstance(a, (int, float))), 1.0)
        if name in ("__neg__", "neg"):
            return [Place(place.index, place.transposed, -place.scale)]
        if name in ("__rsub__", "rsub"):
            return [Place(place.index, place.transposed, -place.scale)]
        if name in SHIFTS:
            return [place]
        factor = 1.0 / c if name in ("__truediv__", "div", "true_divide") else c
        return [Place(place.index, place.transposed, place.scale * factor)]
    source_dim = param.dim() - sum(isinstance(i, int) for i in place.index)
    if name in ("t", "T", "mT", "transpose"):  # the last two dimensions swapped
        last_two = name == "mT" or source_dim == 2 or _is_last_two(args, source_dim)
        if not last_two or source_dim < 2 or place.transposed:
            return None
        return [Place(place.index, True, place.scale)]
    if place.transposed:
        return None  # an index into a transposed view: not placed
    index = _indices(name, args, kwargs, source_dim)
    composed = [compose(place.index, i, param.dim()) for i in index or ()]
    if index is None or any(c is None for c in composed):
        return None
    return [Place(c, False, place.scale) for c in composed]


def _is_last_two(args: tuple, rank: int) -> bool:
    dims = {d % max(rank, 1) for d in args[1:3]} if len(args) >= 3 else set()
    return rank >= 2 and dims == {rank - 2, rank - 1}


def _indices(name: str, args: tuple, kwargs: dict, rank: int) -> list[tuple] | None:
    """Basic indices (ints and slices) into a ``rank`` tensor, one per output of the op."""
    if name == "__getitem__":
        key = args[1] if isinstance(args[1], tuple) else (args[1],)
        key = tuple(
            int(k) if isinstance(k, Tensor) and k.dim() == 0 and not k.is_floating_point() else k
            for k in key
        )
        if not all(isinstance(k, (int, slice)) for k in key):
            return None
        return [key]
    dim = kwargs.get("dim", args[2] if name in ("chunk", "split") and len(args) > 2 else None)
    if name in ("select", "narrow"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if name == "unbind":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim = (dim or 0) % rank
    lead = (slice(None),) * dim
    if name == "select":
        return [(*lead, int(args[2]))]
    if name == "narrow":
        return [(*lead, slice(int(args[2]), int(args[2]) + int(args[3])))]
    size = args[0].shape[dim]
    if name == "unbind":
        return [(*lead, i) for i in range(size)]
    if name not in ("chunk", "split"):
        return None
    if name == "chunk":
        step = -(-size // int(args[1]))
        sizes = [min(step, size - lo) for lo in range(0, size, step)]
    else:  # split: a size or a list of sizes
        n = args[1]
        sizes = (
            list(n)
            if isinstance(n, (list, tuple))
            else [min(n, size - lo) for lo in range(0, size, n)]
        )
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [(*lead, slice(lo, lo + n)) for lo, n in zip(starts, sizes, strict=True)]


def compose(outer: tuple, inner: tuple, rank: int) -> tuple | None:
    """The index into the parameter of ``param[outer][inner]``, both basic; None when it is
    not a plain one (negative or strided slices)."""
    composed, k = [], 0
    outer = list(outer) + [slice(None)] * (rank - len(outer))
    inner = list(inner)
    for o in outer:
        if isinstance(o, int):
            composed.append(o)
            continue
        i = inner[k] if k < len(inner) else slice(None)
        k += 1
        start, stop, step = o.indices(10**18)
        if isinstance(i, int):
            composed.append(start + i * step)
        else:
            a, b, c = i.start or 0, i.stop, i.step or 1
            if a < 0 or (b is not None and b < 0) or step != 1 or c != 1:
                return None
            else:
                composed.append(slice(start + a, stop if b is None else min(stop, start + b)))
    return tuple(composed)
