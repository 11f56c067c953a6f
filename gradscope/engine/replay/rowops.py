"""How each op moves the rows a routed region follows (``rowflow.py``): the example of each row
of its results, from its arguments' (``rows_after``), or NotImplemented where it cannot say."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..ops import (
    ALONG,
    JOINS,
    MATMULS,
    PRODUCTS,
    RESHAPES,
    ROW_REDUCTIONS,
    ROW_WISE,
    SLOTTED,
    SPLITS,
)
from ..tensors import tensors_in
from .forms import merged, split
from .masked import NO_ONE, mask_of, picked, written
from .moved import indexed, moved_after, reduced_dims
from .packrows import packed_after

if TYPE_CHECKING:
    from .rowflow import RowFlow

ATTENTION = {"scaled_dot_product_attention"}  # q, k, v and a mask, each row its own
NORMED = {"rms_norm", "layer_norm"}  # over the trailing dimensions ``normalized_shape`` names


def rows_after(flow: RowFlow, name: str, args: tuple, kwargs: dict, out: object):
    """The rows of ``out`` (a tuple of them for several outputs; ``Along`` another dimension
    than 0), or NotImplemented."""
    if name in SLOTTED:
        return packed_after(flow, name, args, kwargs, out)
    moved = moved_after(flow, name, args, kwargs, out)
    if moved is not None:
        return moved
    x = args[0]
    if name == "__getitem__":
        return _indexed(flow, x, args[1], out)
    if name == "index_select":
        dim, index = kwargs.get("dim", args[1] if len(args) > 1 else None), args[-1]
        return _picked(flow, x, index, out) if dim == 0 else _kept(flow, x, out, dim)
    if name in ("index_add", "index_add_", "index_copy", "index_copy_"):
        return _added(flow, args, kwargs, copy=name.startswith("index_copy"))
    if name == "__setitem__" and (mask := mask_of(x, args[1])) is not None:
        return written(flow, x, mask, args[2])
    if name == "__setitem__":
        return NotImplemented if flow.of(x) is not False or flow.of(args[2]) is not False else False
    if name in JOINS:
        return _joined(flow, name, args, kwargs, out)
    if name in ALONG:  # within each row, along another dimension: rows kept, and met
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(dim, int) or not x.dim() or dim % x.dim() == 0:
            return NotImplemented
        return _row_wise(flow, args, kwargs, out)
    if name in NORMED:  # Ergo's experts' outputs, each row normalised alone
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
        n = 1 if isinstance(shape, int) else len(shape) if isinstance(shape, (tuple, list)) else 0
        return _row_wise(flow, args, kwargs, out) if 0 < n < x.dim() else NotImplemented
    if name in PRODUCTS:  # row by row, on weights of no example; offsets are positions
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        return _same_rows(flow, x, out) if flow.of(w) is False else NotImplemented
    if name in MATMULS and len(args) == 2 and _by_matrix(x, args[1]):  # x @ W, W no one's
        return _same_rows(flow, x, out) if flow.of(args[1]) is False else NotImplemented
    if name in ROW_WISE or name in ATTENTION or (name in MATMULS and _batched(args)):
        return _row_wise(flow, args, kwargs, out)  # attention: within each example's rows
    if name == "repeat" and _repeats(args)[:1] == (1,) and len(_repeats(args)) == x.dim():
        return _same_rows(flow, x, out)  # JetMoE's keys, repeated along the heads
    if name == "repeat_interleave":
        return _interleaved(flow, args, kwargs, out)
    if name in SPLITS:
        dim = kwargs.get("dim", args[2] if len(args) > 2 and name != "unbind" else 0)
        dim = args[1] if name in ("unbind", "select", "narrow") and len(args) > 1 else dim
        if dim == 0 and name in ("split", "split_with_sizes", "chunk", "tensor_split"):
            return _pieces(flow, x, out)
        return _kept(flow, x, out, dim)
    if name in RESHAPES:
        return _reshaped(flow, x, out)
    if name in ("sort", "topk") and x.dim() == 1 and isinstance(out, tuple):
        rows = flow.of(x)  # values moved to the places the indices say; those are positions
        return NotImplemented if rows is None else (rows[out[1]], False)
    if name in ROW_REDUCTIONS:
        return _kept(flow, x, out, reduced_dims(name, args, kwargs))
    if name == "one_hot":
        return _same_rows(flow, x, out)
    return NotImplemented


def _batched(args: tuple) -> bool:
    """Whether a matrix product of two operands is batched along dimension 0 of both."""
    return len(args) == 2 and all(isinstance(t, Tensor) and t.dim() >= 3 for t in args)


def _repeats(args: tuple) -> tuple:
    """``x.repeat(*sizes)``'s sizes."""
    sizes = args[1:] if len(args) != 2 or not isinstance(args[1], (list, tuple)) else args[1]
    return tuple(sizes)


def _by_matrix(x: object, w: object) -> bool:
    """Whether ``x @ w`` multiplies each row of x (rows along dimension 0) by a matrix."""
    return isinstance(x, Tensor) and isinstance(w, Tensor) and x.dim() >= 2 and w.dim() == 2


def _kept(flow: RowFlow, x: Tensor, out: object, dim) -> object:
    """An op along ``dim`` (an int, a tuple of them, None: every dimension) keeps x's rows."""
    rows = flow.of(x)
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    if rows is None or not all(isinstance(d, int) for d in dims) or not x.dim():
        return NotImplemented
    if any(d % x.dim() == 0 for d in dims):
        return NotImplemented
    if isinstance(out, (tuple, list)):
        return tuple(rows if isinstance(t, Tensor) else None for t in out)
    return rows


def _interleaved(flow: RowFlow, args: tuple, kwargs: dict, out: object) -> object:
    """``x.repeat_interleave(repeats, dim)``: along dimension 0 each row repeated in place
    (Ergo's tokens, one row per route), repeats an int or counts of no example; along
    another, rows kept."""
    x, dim = args[0], kwargs.get("dim", args[2] if len(args) > 2 else None)
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    rows = flow.of(x)
    if not isinstance(x, Tensor) or not isinstance(dim, int) or not x.dim() or rows is None:
        return NotImplemented
    if dim % x.dim():
        return _kept(flow, x, out, dim)
    if rows is False or flow.of(repeats) is not False:
        return NotImplemented if rows is not False else False
    if isinstance(repeats, int):
        form = flow.form(rows)
        return flow.formed(
            rows.repeat_interleave(repeats), None if form is None else split(form, repeats)
        )
    return rows.repeat_interleave(repeats)


def _pieces(flow: RowFlow, x: Tensor, out: object) -> object:
    """x split along dimension 0 into consecutive pieces (``x.split(sizes)``, JetMoE's tokens
    per expert): each piece's rows are x's rows at its place."""
    rows = flow.of(x)
    if rows is None or not isinstance(out, (tuple, list)) or not x.dim():
        return NotImplemented
    if rows is False:
        return tuple(False for _ in out)
    pieces, start = [], 0
    for t in out:
        pieces.append(rows[start : start + t.shape[0]])
        start += t.shape[0]
    return tuple(pieces)


def _same_rows(flow: RowFlow, x: Tensor, out: object) -> object:
    """A view whose dimension 0 is x's."""
    rows = flow.of(x)
    ok = isinstance(out, Tensor) and out.dim() and x.dim() and out.shape[0] == x.shape[0]
    return rows if ok and rows is not None else NotImplemented


def _row_wise(flow: RowFlow, args: tuple, kwargs: dict, out: object) -> object:
    """Elementwise (broadcast), casts, and row-by-row products with weights of no example:
    every followed input lays its rows along the output's dimension 0."""
    o = out if isinstance(out, Tensor) else args[0]
    if not isinstance(o, Tensor) or o.dim() == 0:
        return NotImplemented
    found = []
    for t in tensors_in(args, kwargs):
        rows = flow.of(t)
        if rows is False:
            continue
        if rows is None or t.dim() != o.dim() or t.shape[0] != o.shape[0]:
            return NotImplemented
        found.append(rows)
    return flow.combine(found) if found else False


def _indexed(flow: RowFlow, x: Tensor, index: object, out: object) -> object:
    """``x[index]``: rows picked by a tensor on dimension 0, or kept by slices after it."""
    key = index if isinstance(index, tuple) else (index,)
    if not key or not isinstance(out, Tensor) or out.dim() == 0:
        return NotImplemented
    first = key[0]
    if (mask := mask_of(x, index, leading=True)) is not None:  # Ergo's tokens of one expert
        return picked(flow, x, mask, out)
    if isinstance(first, Tensor):
        pickers = [k for k in key if isinstance(k, Tensor)]
        if (
            first.dim() != 1
            or first.dtype == torch.bool
            or any(k.shape != first.shape for k in pickers)
        ):
            return NotImplemented
        found = [r for k in pickers if (r := flow.of(k)) is not False]
        if any(r is None for r in found):
            return NotImplemented
        rows = flow.of(x)
        if rows is None:
            return NotImplemented
        if rows is not False and not found and len(pickers) == 1:
            return flow.picked(rows, first)
        chosen = [rows[first]] if rows is not False else []
        return flow.combine(chosen + found) if chosen or found else False
    if first is None or any(isinstance(k, Tensor) for k in key):  # x[None, idx], x[:, idx]
        return indexed(flow, x, key, out)
    if isinstance(first, slice) and first != slice(None):  # x[a:b]: those rows
        rows = flow.of(x)
        return (
            rows[first] if isinstance(rows, Tensor) else (NotImplemented if rows is None else False)
        )
    plain = first == slice(None) or (
        first is Ellipsis and sum(k is not None for k in key) <= x.dim()
    )
    return _same_rows(flow, x, out) if plain else NotImplemented


def _picked(flow: RowFlow, x: Tensor, index: Tensor, out: object) -> object:
    rows, own = flow.of(x), flow.of(index)
    if rows is None or own is None or index.dim() != 1:
        return NotImplemented
    if rows is not False and own is False:
        return flow.picked(rows, index)
    found = ([rows[index]] if rows is not False else []) + ([own] if own is not False else [])
    return flow.combine(found) if found else False


def _added(flow: RowFlow, args: tuple, kwargs: dict, copy: bool = False) -> object:
    """``x.index_add(0, index, source)``: row index[j] of x gains source's row j (``copy``:
    ``index_copy``, takes it: x's row there is gone)."""
    x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
    index = kwargs.get("index", args[2] if len(args) > 2 else None)
    source = kwargs.get("source", args[3] if len(args) > 3 else None)
    base, own, rows = flow.of(x), flow.of(index), flow.of(source)
    if dim != 0 or base is None or rows is None or own is not False or index.dim() != 1:
        return NotImplemented
    if rows is False:
        return base
    start = base if base is not False else index.new_full((x.shape[0],), NO_ONE)
    placed = start.clone().scatter_(0, index, rows)
    flow.flag(placed[index] != rows)  # every row written there is one example's
    if not copy:
        flow.flag((start[index] != NO_ONE) & (start[index] != rows))
    return placed


def _reshaped(flow: RowFlow, x: Tensor, out: object) -> object:
    """A reshape: rows split (each output row in one input row) or merged (each output row of
    whole input rows, which must be one example's)."""
    rows = flow.of(x)
    if rows is None or not isinstance(out, Tensor) or not x.dim() or not out.dim():
        return NotImplemented
    n, m = x.shape[0], out.shape[0]
    if not x.numel() or n == m:
        return rows if n == m else NotImplemented
    per_in, per_out = x.numel() // n, out.numel() // m
    form = flow.form(rows)
    if per_in % per_out == 0:
        k = per_in // per_out
        return flow.formed(rows.repeat_interleave(k), None if form is None else split(form, k))
    if per_out % per_in:
        return NotImplemented
    k = per_out // per_in
    whole = rows.view(m, k)
    found = whole.amax(1)
    after = None if form is None else merged(form, k)
    if after is None:  # rows of one example each, or of none, as the values say
        flow.flag(((whole != found[:, None]) & (whole != NO_ONE)).any(1))
    return flow.formed(found, after)


def _joined(flow: RowFlow, name: str, args: tuple, kwargs: dict, out: object) -> object:
    """``cat``/``stack`` along another dimension than 0 keep the rows (which meet); ``cat``
    along dimension 0 puts each tensor's rows after the previous one's."""
    tensors = args[0] if args and isinstance(args[0], (list, tuple)) else None
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if tensors is None or not isinstance(dim, int) or not isinstance(out, Tensor) or not out.dim():
        return NotImplemented
    if dim % out.dim():
        return _row_wise(flow, (*tensors,), {}, out)
    if name == "stack" or any(t.dim() == 0 for t in tensors):
        return NotImplemented
    rows = [flow.of(t) for t in tensors]
    if any(r is None for r in rows):
        return NotImplemented
    full = [
        r if r is not False else out.new_full((t.shape[0],), NO_ONE, dtype=torch.long)
        for t, r in zip(tensors, rows, strict=True)
    ]
    return torch.cat(full)
