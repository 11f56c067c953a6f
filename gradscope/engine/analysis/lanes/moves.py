"""The lanes of views and reshapes: the elements of one tensor moved, so the lane is where its
dimension lands (``LANE_MOVES``, by op name)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from torch import Tensor

from ...ops import CAST_LIKE, RESHAPES
from ..owners import groups
from .base import Lane, aligned, axis, only, same


def _reshape(args, kwargs, lanes, out, batch) -> Lane | None:
    """view, reshape, flatten, unflatten, squeeze, unsqueeze: the elements in the same order,
    so the lane is where its period lands in the new shape (``reshape_lane``)."""
    lane = only(args, kwargs, lanes)
    return None if lane is None else reshape_lane(args[0].shape, out.shape, lane, batch)


@functools.lru_cache(maxsize=4096)  # the same few reshapes in every pass of a model
def reshape_lane(shape: Sequence[int], new: Sequence[int], lane: Lane, batch: int) -> Lane | None:
    """The lane of ``t.reshape(new)`` for ``t`` of ``shape`` with ``lane``. Within the group of
    dimensions the lane's dimension is merged or split with, element f (row-major) belongs to
    example (f // P) % B, P the size of the dimensions after the lane's in the group times m:
    the lane is the new dimension j whose inner size divides P and whose size is a multiple of
    B*m' (m' = P / inner size), where that formula reads as (i_j // m') % B."""
    d, m = lane
    for i0, i1, j0, j1 in groups(shape, new) or ():
        if not i0 <= d < i1:
            continue
        period, inner = math.prod(shape[d + 1 : i1]) * m, 1
        for j in range(j1 - 1, j0 - 1, -1):
            if period % inner == 0 and new[j] % (period // inner * batch) == 0:
                return j, period // inner
            inner *= new[j]
    return None


def _swap(args, kwargs, lanes, out, batch) -> Lane | None:
    """transpose, swapaxes, swapdims."""
    lane, n = only(args, kwargs, lanes), args[0].dim()
    a = axis(kwargs.get("dim0", args[1] if len(args) > 1 else None), n)
    b = axis(kwargs.get("dim1", args[2] if len(args) > 2 else None), n)
    if lane is None or a is None or b is None:
        return None
    d = b if lane[0] == a else a if lane[0] == b else lane[0]
    return d, lane[1]


def _reversed(args, kwargs, lanes, out, batch) -> Lane | None:
    """t and T reverse the dimensions; mT swaps the last two."""
    lane = only(args, kwargs, lanes)
    return None if lane is None else (out.dim() - 1 - lane[0], lane[1])


def _matrix_transpose(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = only(args, kwargs, lanes), args[0].dim()
    if lane is None or n < 2:
        return None
    d = {n - 1: n - 2, n - 2: n - 1}.get(lane[0], lane[0])
    return d, lane[1]


def _permute(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = only(args, kwargs, lanes), args[0].dim()
    dims = kwargs.get("dims", args[1:])
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = [axis(k, n) for k in dims]
    if lane is None or lane[0] not in dims:
        return None
    return dims.index(lane[0]), lane[1]


def _movedim(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = only(args, kwargs, lanes), args[0].dim()
    src = kwargs.get("source", args[1] if len(args) > 1 else None)
    dst = kwargs.get("destination", args[2] if len(args) > 2 else None)
    src = [axis(k, n) for k in (src if isinstance(src, (list, tuple)) else (src,))]
    dst = [axis(k, n) for k in (dst if isinstance(dst, (list, tuple)) else (dst,))]
    if lane is None or None in src or None in dst or len(src) != len(dst):
        return None
    if lane[0] in src:
        return dst[src.index(lane[0])], lane[1]
    rest = [k for k in range(n) if k not in src]  # the others keep their order
    free = [k for k in range(n) if k not in dst]
    return free[rest.index(lane[0])], lane[1]


def _expand(args, kwargs, lanes, out, batch) -> Lane | None:
    lane = only(args, kwargs, lanes)
    return None if lane is None else aligned(args[0], lane, out)


def _index(args, kwargs, lanes, out, batch) -> Lane | None:
    """``x[key]`` with ints, slices, None and ``...``, that takes the lane's dimension whole."""
    lane, n = only(args, kwargs, lanes), args[0].dim()
    key = args[1] if len(args) > 1 else None
    key = key if isinstance(key, tuple) else (key,)
    if lane is None or not all(k is None or k is Ellipsis or _plain(k) for k in key):
        return None
    used = sum(k is not None and k is not Ellipsis for k in key)
    d, at, to = lane[0], 0, 0  # the lane's dimension; where the key is in x and in out
    for k in key:
        if k is None:
            to += 1
            continue
        span = n - used if k is Ellipsis else 1
        if at <= d < at + span:
            whole = k is Ellipsis or (
                isinstance(k, slice) and k.start is None and k.stop is None and k.step is None
            )
            return (to + d - at, lane[1]) if whole else None
        at += span
        to += 0 if isinstance(k, int) else span
    return to + d - at, lane[1]


def _plain(k: object) -> bool:
    return isinstance(k, slice) or (isinstance(k, int) and not isinstance(k, bool))


def _select(args, kwargs, lanes, out, batch) -> Lane | None:
    """select(dim, i) drops a dimension; narrow(dim, start, length) shortens it."""
    lane, n = only(args, kwargs, lanes), args[0].dim()
    dim = axis(kwargs.get("dim", args[1] if len(args) > 1 else None), n)
    if lane is None or dim is None or dim == lane[0]:
        return None
    dropped = out.dim() < n and dim < lane[0]
    return lane[0] - dropped, lane[1]


def _split(args, kwargs, lanes, out, batch) -> Lane | None:
    """split, chunk, tensor_split, split_with_sizes and unbind along another dimension."""
    lane, n = only(args, kwargs, lanes), args[0].dim()
    if out.dim() < n:  # unbind(dim)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    else:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    dim = axis(dim, n)
    if lane is None or dim is None or dim == lane[0]:
        return None
    return lane[0] - (out.dim() < n and dim < lane[0]), lane[1]


def _joined(args, kwargs, lanes, out, batch) -> Lane | None:
    """cat and stack of tensors all on the same lane, along another dimension."""
    parts = args[0]
    if not parts or not all(isinstance(t, Tensor) and id(t) in lanes for t in parts):
        return None
    lane = same(lanes[id(t)] for t in parts)
    dim = axis(kwargs.get("dim", args[1] if len(args) > 1 else 0), out.dim())
    if lane is None or dim is None or any(t.dim() != parts[0].dim() for t in parts):
        return None
    if out.dim() == parts[0].dim():  # cat
        return None if dim == lane[0] else lane
    return lane[0] + (dim <= lane[0]), lane[1]


def _cast(args, kwargs, lanes, out, batch) -> Lane | None:
    """x.to(y), x.type_as(y): the other tensor gives a dtype only."""
    lane = lanes.get(id(args[0]))
    return lane if len(lanes) == 1 and lane is not None and out.dim() == args[0].dim() else None


LANE_MOVES: dict[str, Callable[..., Lane | None]] = {
    **dict.fromkeys(RESHAPES | {"squeeze", "unsqueeze"}, _reshape),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims"), _swap),
    **dict.fromkeys(("t", "T"), _reversed),
    "mT": _matrix_transpose,
    "permute": _permute,
    **dict.fromkeys(("movedim", "moveaxis"), _movedim),
    **dict.fromkeys(("expand", "expand_as"), _expand),
    "__getitem__": _index,
    **dict.fromkeys(("select", "narrow"), _select),
    **dict.fromkeys(("split", "chunk", "tensor_split", "split_with_sizes", "unbind"), _split),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _joined),
    **dict.fromkeys(CAST_LIKE, _cast),
}
