"""Rows along another dimension than 0 (``rowflow.py``): where a view moves the examples off
dimension 0 (``mask.permute(2, 1, 0)``, ``x[None, idx]``) a tensor's rows lie along dimension
``d``: slice ``r`` along it is example ``rows[r]``'s, every element of it. Only the ops that
move or keep whole slices follow them: views that move dimensions, indexing by ints, slices,
``None`` and one index tensor of no example (``index_select`` too: a sequence-first batch
sorted for its pack), reshapes whose every index along one output dimension falls in one
slice, elementwise ops whose followed tensors lie along one dimension, and reductions and
splits along another; at dimension 0 again they are rows as ``rowops.py`` takes them. Any
other op on such a tensor leaves its results unfollowed."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..ops import DIM_MOVES, EXPAND, RESHAPES, ROW_REDUCTIONS, ROW_WISE
from ..tensors import tensors_in

if TYPE_CHECKING:
    from .rowflow import RowFlow


class Along(NamedTuple):
    """A tensor's rows along dimension ``dim`` (> 0)."""

    rows: Tensor
    dim: int


def moved_after(flow: RowFlow, name: str, args: tuple, kwargs: dict, out: object) -> object:
    """``out``'s rows (``Along``, rows at dimension 0, a tuple of them, or NotImplemented)
    where an argument's rows lie along another dimension than 0 or the op moves dimensions;
    None where neither, for ``rowops.py`` to say."""
    x = args[0] if args else None
    moves = name in DIM_MOVES or name in EXPAND
    if not moves and not (flow.along and any(map(flow.off, tensors_in(args, kwargs)))):
        return None
    at = flow.at(x)
    if name in ROW_WISE:
        return _row_wise(flow, args, kwargs, out)
    if not isinstance(at, tuple) or not isinstance(x, Tensor):
        return NotImplemented  # rows along another dimension meet x's at some op
    others = tensors_in(args, kwargs) if name != "expand_as" else ()  # y gives a shape
    if any(t is not x and flow.at(t) is not False for t in others):
        return NotImplemented
    rows, d = at
    if name in DIM_MOVES:
        return _placed(rows, _moved(name, args, kwargs, x, d), out)
    if name == "__getitem__":
        return indexed(flow, x, args[1] if isinstance(args[1], tuple) else (args[1],), out)
    if name == "index_select" and len(args) == 3 and type(args[1]) is int:  # x[:, ..., index]
        return indexed(flow, x, (*(slice(None),) * (args[1] % x.dim()), args[2]), out)
    if name in RESHAPES:
        return _reshaped(rows, d, x, out)
    if name in EXPAND or name == "one_hot":  # new dimensions before, or one after
        return _placed(rows, d + (out.dim() - x.dim() if name != "one_hot" else 0), out)
    if name in ROW_REDUCTIONS or name in ("select", "unbind", "narrow", "chunk", "split"):
        return _along_other(name, reduced_dims(name, args, kwargs), x, rows, d, out)
    return NotImplemented


def _placed(rows: Tensor, d: int | None, out: object) -> object:
    """``rows`` along dimension ``d`` of ``out`` (of each of its tensors)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if d is None or not all(isinstance(o, Tensor) and o.dim() > d >= 0 for o in outs):
        return NotImplemented
    if any(o.shape[d] != rows.shape[0] for o in outs):
        return NotImplemented
    at = Along(rows, d) if d else rows
    return tuple(at for _ in outs) if isinstance(out, (tuple, list)) else at


def _moved(name: str, args: tuple, kwargs: dict, x: Tensor, d: int) -> int | None:
    """Where dimension ``d`` of ``x`` goes in a view that moves dimensions; None where the view
    drops it (a squeeze of a dimension of one row) or the arguments are not plain ints."""
    n, rest = x.dim(), [*args[1:], *kwargs.values()]
    if name == "permute":
        dims = rest[0] if rest and isinstance(rest[0], (list, tuple)) else rest
        return [k % n for k in dims].index(d) if len(dims) == n else None
    if name in ("transpose", "swapaxes", "swapdims", "t", "mT") and n >= 2:
        a, b = rest[:2] if name not in ("t", "mT") else (n - 2, n - 1)
        a, b = a % n, b % n
        return b if d == a else a if d == b else d
    if name == "T":
        return n - 1 - d
    if name in ("movedim", "moveaxis"):
        src, dst = (tuple(k) if isinstance(k, (list, tuple)) else (k,) for k in rest[:2])
        order = dict(zip((t % n for t in dst), (s % n for s in src), strict=True))
        left = iter(k for k in range(n) if k not in order.values())
        return [order[i] if i in order else next(left) for i in range(n)].index(d)
    if name == "unsqueeze":
        k = rest[0] % (n + 1)
        return d + (k <= d)
    if name == "squeeze":
        dims = range(n) if not rest else rest[0] if isinstance(rest[0], (tuple, list)) else rest
        gone = {k % n for k in dims if x.shape[k] == 1}
        return None if d in gone else d - sum(k < d for k in gone)
    return None


def indexed(flow: RowFlow, x: Tensor, key: tuple, out: object) -> object:
    """``x[key]`` for a key of ints, slices, ``None``, ``...`` and at most one 1-D integer
    index tensor of no example (which then stands where it is: the only advanced index)."""
    at = flow.at(x)
    if not isinstance(at, tuple) or not isinstance(out, Tensor):
        return NotImplemented
    plain = (k is None or k is Ellipsis or type(k) in (int, slice) for k in key)
    (rows, d), tensors = at, [k for k in key if isinstance(k, Tensor)]
    if len(tensors) + sum(plain) != len(key) or len(tensors) > 1:
        return NotImplemented
    if tensors and (tensors[0].dim() != 1 or tensors[0].is_floating_point()):
        return NotImplemented
    if tensors and (tensors[0].dtype == torch.bool or flow.of(tensors[0]) is not False):
        return NotImplemented
    used = sum(k is not None and k is not Ellipsis for k in key)
    dots = [j for j, k in enumerate(key) if k is Ellipsis] or [len(key)]
    if used > x.dim() or len(dots) > 1:
        return NotImplemented
    key = (*key[: dots[0]], *(slice(None),) * (x.dim() - used), *key[dots[0] + 1 :])
    i, o = 0, 0
    for k in key:
        if k is None:
            o += 1
            continue
        if i == d:
            if isinstance(k, Tensor):
                return _placed(flow.picked(rows, k), o, out)
            return _placed(rows[k], o, out) if isinstance(k, slice) else NotImplemented
        i, o = i + 1, o + (not isinstance(k, int))
    return NotImplemented


def _reshaped(rows: Tensor, d: int, x: Tensor, out: object) -> object:
    """A reshape: the first dimension of ``out`` whose every index falls in one slice along
    ``d`` of ``x`` (the slices' sizes dividing its elements' spacing, their span its length),
    along which the rows are repeated, each q times and the whole c times."""
    if not isinstance(out, Tensor) or not x.numel():
        return NotImplemented
    n, post = x.shape[d], math.prod(x.shape[d + 1 :])
    for k in range(out.dim()):
        size, step = out.shape[k], math.prod(out.shape[k + 1 :])
        if post % step == 0 and (step * size) % (post * n) == 0:
            q, c = post // step, step * size // (post * n)
            return _placed(rows.repeat_interleave(q).repeat(c) if q * c > 1 else rows, k, out)
    return NotImplemented


def reduced_dims(name: str, args: tuple, kwargs: dict) -> tuple:
    """The dimensions a reduction (``ROW_REDUCTIONS``) or a split of ``args[0]`` goes along;
    ``(None,)`` where every one."""
    i = 2 if name in ("topk", "norm", "chunk", "split") else 1  # x.norm(p, dim): p first
    default = (
        -1 if name in ("topk", "sort") else 0 if name in ("unbind", "chunk", "split") else None
    )
    dim = kwargs.get("dim", args[i] if len(args) > i else default)
    return tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)


def _along_other(name: str, dims: tuple, x: Tensor, rows: Tensor, d: int, out: object) -> object:
    """A reduction or a split along ``dims``, not ``d``: the rows kept, at ``d`` or before it
    by the dimensions reduced or selected before it."""
    if not all(type(k) is int for k in dims) or d in {k % x.dim() for k in dims}:
        return NotImplemented
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, Tensor):
        return NotImplemented
    gone = first.dim() < x.dim()  # keepdim False, or a dimension selected
    return _placed(rows, d - (gone and sum(k % x.dim() < d for k in dims)), out)


def _row_wise(flow: RowFlow, args: tuple, kwargs: dict, out: object) -> object:
    """Elementwise ops and casts: every followed tensor's rows along one dimension of the
    output's rank, of its length there."""
    o = out if isinstance(out, Tensor) else args[0]
    if not isinstance(o, Tensor) or o.dim() == 0:
        return NotImplemented
    found, dims = [], set()
    for t in tensors_in(args, kwargs):
        at = flow.at(t)
        if at is False:
            continue
        if at is None or t.dim() != o.dim() or t.shape[at[1]] != o.shape[at[1]]:
            return NotImplemented
        found.append(at[0])
        dims.add(at[1])
    if len(dims) != 1:
        return NotImplemented if dims else False
    return _placed(flow.combine(found), dims.pop(), o)
