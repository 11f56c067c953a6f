"""The owners of an op's results by the owner algebra (``owners.py``): the trace's path for
the ops whose owners its lanes (``lanes/``) cannot tell from shapes alone: moves of rows
(index, gather, masks, sort, cat), writes in place, scatters, strided views, reductions and
contractions that mix a dimension of examples, and ops it does not know."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops import (
    CAST_LIKE,
    CREATIONS,
    ELEMENTWISE,
    ELEMENTWISE_IN_PLACE,
    IN_PLACE_MOVES,
    INDICES,
    MOVES,
    PLACES,
    REDUCTIONS,
    RESHAPES,
    SCATTERS,
    SORTS,
    ZEROING,
)
from ..tensors import tensors_in
from .arguments import binary, dims_of, filled
from .contractions import CONTRACTIONS
from .owners import (
    MIXED,
    NONE,
    combine,
    compact,
    reduce,
    reshaped,
    scatter_combine,
    segment_combine,
    shrink,
)
from .picks import Picks
from .selectors import Selectors


class OwnerAlgebra(Picks, Selectors):
    """The trace's owners of one op by the algebra (``RowTrace`` is one): uses its batch,
    device, ``owners``, ``selectors``, ``owner``, ``lane``, ``unknown`` and ``_set``."""

    def _follow(self, name: str, func, args: tuple, kwargs: dict, out: object, origin: str):
        if self._picked(name, args, kwargs):
            self.picked(name)
        self._selects(name, func, args, kwargs, out)
        if name in INDICES and len(args) == 1:  # positions, not values: nothing flows back
            outs = out if isinstance(out, (tuple, list)) else (out,)  # as_tuple: one per dim
            return self._set(out, tuple(filled(t, NONE) for t in outs), origin)
        if name in CREATIONS:
            return self._set(out, filled(out, NONE), origin)
        if name in SORTS:
            return self._set(out, self._sorted(name, args, kwargs, out), origin)
        if name in PLACES:  # in place or not
            target = args[0] if name.endswith("_") else out
            o = self._placed(name, args, kwargs)
            return self._set(target, o, self._crossing(name, origin))
        if name in IN_PLACE_MOVES:
            return self._in_place(name, args, kwargs, origin)
        if name == "take" and isinstance(args[0], Tensor):  # x.reshape(-1)[index]
            return self._set(out, self._took(args, kwargs), self._crossing(name, origin))
        if name in ("index_put", "index_put_"):  # x[indices] = values, in place or not
            target, o = args[0] if name.endswith("_") else out, self._index_put(args, kwargs)
            return self._set(target, o, self._crossing(name, origin))
        if name in SCATTERS:
            return self._scatter(name, args, kwargs, out, origin)
        if name in ELEMENTWISE_IN_PLACE and isinstance(args[0], Tensor):  # x += y
            return self._set(args[0], combine(*self._all(args, kwargs)), origin)
        if name.endswith("_") and not name.startswith("__"):  # x.add_(y): x takes y's owners
            if name[:-1] in ELEMENTWISE and isinstance(args[0], Tensor):
                return self._set(args[0], combine(*self._all(args, kwargs)), origin)
            return self._set(args[0], None, origin)
        if name in RESHAPES:
            return self._set(out, self._reshape(name, args, out), origin)
        if func is F.unfold:  # im2col, not the window view Tensor.unfold
            return self._set(out, CONTRACTIONS["im2col"](self, *args, **kwargs), origin)
        if name in MOVES:
            o = self._move(func, args, kwargs, name in ZEROING)
            return self._set(out, o, self._crossing(name, origin))
        if name == "as_strided":
            return self._set(out, self._strided(args, kwargs), origin)
        if name in ELEMENTWISE or binary(name, args, kwargs):
            return self._set(out, combine(*self._all(args, kwargs)), origin)
        if name in CAST_LIKE:  # the other tensor gives only a dtype
            return self._set(out, compact(self.owner(args[0])), origin)
        if name in REDUCTIONS and isinstance(args[0], Tensor):
            dims, keep = dims_of(name, args, kwargs, args[0].dim())
            o, n = self.owner(args[0]), args[0].dim()
            lane = self.lane(o) if self.batch > 1 else None
            if lane is not None and lane[0] in {d % n for d in dims}:
                return self._set(out, None, origin)  # over every example: all MIXED
            return self._set(out, reduce(o, dims, keep), origin)
        if name in CONTRACTIONS:
            return self._set(out, CONTRACTIONS[name](self, *args, **kwargs), origin)
        self.unknown.setdefault(name)
        self._set(out, self._leading(args, kwargs, out), origin)

    def _of_batch(self, t: Tensor) -> bool:
        """Whether ``t``'s values are computed from the batch (not decided by its shapes alone:
        ``fixed.py``)."""
        return t in self.owners and not self.created.get(t)

    def _varies(self, x: Tensor, dims) -> bool:
        """Whether ``x``'s owners may differ along any of ``dims``."""
        o = compact(self.owner(x))
        return any(o.shape[d % o.dim()] > 1 for d in dims) if o.dim() else False

    def _all(self, args: tuple, kwargs: dict) -> list[Tensor]:
        return [self.owner(t) for t in tensors_in(args, kwargs)] or [
            torch.tensor(NONE, device=self.device)
        ]

    def _reshape(self, name: str, args: tuple, out: Tensor) -> Tensor | None:
        x = args[0]
        return reshaped(self.owner(x), x.shape, out.shape)

    def _move(self, func, args: tuple, kwargs: dict, zeroing: bool = False) -> object:
        """The op on the owners, expanded (no copy) to the shapes of the tensors they describe;
        ``zeroing``: the zeros it writes (tril, triu) are constants, NONE, not example 0."""

        def full(t: object) -> object:
            if isinstance(t, Tensor):
                return self.owner(t).expand(t.shape)
            if isinstance(t, (list, tuple)):
                return type(t)(full(u) for u in t)
            return t

        if zeroing:
            return shrink(func(full(args[0]) - NONE, *args[1:], **kwargs) + NONE)
        o, name = full(args[0]), func.__name__
        if name == "__getitem__" and len(args) > 1:
            o = self._masked(args[0], args[1], o)
        elif name == "masked_select":  # x and the mask broadcast
            o, mask = torch.broadcast_tensors(o, self.selector(args[1]))
            o = self._apart(o, mask)
        result = func(o, *args[1:], **kwargs)
        if name == "__getitem__" and len(args) > 1:
            result = self._indexed(args[0], args[1], result)
        elif name in ("index_select", "gather", "take_along_dim"):
            result = self._along(name, args, kwargs, result)
        # shrink narrows the full-shaped result to a view: a copy of its own lets the rest go
        if isinstance(result, (tuple, list)):
            return tuple(shrink(r).clone() for r in result)
        return shrink(result).clone()

    def _strided(self, args: tuple, kwargs: dict) -> Tensor | None:
        """``x.as_strided(size, stride, offset)`` (Longformer's overlapping chunks): owners laid
        out in memory as ``x``'s elements are, the same view taken of them; memory between
        ``x``'s elements is MIXED (not known), and a view reaching outside ``x`` is None."""
        x = args[0]
        size, stride, offset = (
            *args[1:],
            *(kwargs[k] for k in ("size", "stride", "storage_offset") if k in kwargs),
            None,
        )[:3]
        start = x.storage_offset()
        offset = start if offset is None else offset
        span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True))
        last = offset - start + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if x.numel() == 0 or offset < start or (min(size, default=1) > 0 and last >= span):
            return None
        memory = torch.full((span,), MIXED, dtype=torch.long, device=x.device)
        memory.as_strided(x.shape, x.stride()).copy_(self.owner(x).expand(x.shape))
        return shrink(memory.as_strided(size, stride, offset - start))

    def _leading(self, args: tuple, kwargs: dict, out: object) -> Tensor | None:
        """An unknown op: each output keeps dimension 0's owners, when every tracked input's
        dimension 0 has the output's length."""
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(first, Tensor) or first.dim() == 0:
            return None
        lead = []
        for t in tensors_in(args, kwargs):
            if t in self.owners:
                if t.dim() == 0 or t.shape[0] != first.shape[0]:
                    return None
                lead.append(reduce(self.owner(t), range(1, t.dim())).reshape(-1))
        o = combine(*lead) if lead else filled(first[:1], NONE)
        return o.view(-1, *([1] * (first.dim() - 1)))

    def _sorted(self, name: str, args: tuple, kwargs: dict, out: object) -> tuple:
        """sort's values carry the owners of where they came from; its indices are positions."""
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
        order = out if name == "argsort" else out[1]
        moved = self.owner(x).expand(x.shape).gather(dim, order)
        none = filled(order, NONE)
        return none if name == "argsort" else (shrink(moved), none)

    def _scatter(self, name: str, args: tuple, kwargs: dict, out: object, origin: str) -> None:
        """``x.scatter_add(dim, index, src)`` and its kin: each target combines its own owner
        (kept by an add or a reduce including itself, overwritten by ``scatter``) with those
        of the values that land on it."""
        x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
        src = kwargs.get("src", args[3] if len(args) > 3 else kwargs.get("value"))
        dim = dim % x.dim()
        base = self.owner(x).expand(x.shape).clone()
        if isinstance(src, Tensor):
            values = self.owner(src).expand(src.shape)[tuple(slice(0, n) for n in index.shape)]
        else:
            values = torch.full(index.shape, NONE, dtype=torch.long, device=x.device)
        keep = name.startswith("scatter_add") or (
            name.startswith("scatter_reduce") and kwargs.get("include_self", True)
        )
        if self._in_rows(name, args, kwargs):  # each row its source row's, wherever written
            o = combine(base, reduce(values, [dim])).expand(x.shape)
        else:
            o = scatter_combine(base, dim, index, values.contiguous(), keep)
        o = shrink(self._scattered(o, dim, index))  # placed by another example's index: MIXED
        self._set(x if name.endswith("_") else out, o, self._crossing(name, origin))

    def _in_place(self, name: str, args: tuple, kwargs: dict, origin: str) -> None:
        x = args[0]
        if name in ("fill_", "zero_"):
            return self._set(x, filled(x, NONE), origin)
        if name == "copy_":
            return self._set(x, compact(self.owner(args[1]).expand(x.shape)), origin)
        value = args[2] if len(args) > 2 else kwargs.get("value")
        v = self.owner(value) if isinstance(value, Tensor) else torch.tensor(NONE)
        o = self.owner(x).expand(x.shape).clone()
        if name == "masked_fill_":  # masked elements take the fill (a 0-dim value)
            # owners that a mask of the batch's values places, and no need recorded for them:
            # an element filled with no example's value carries no example's gradient, and
            # rows of none are read by position whatever the mask (B rows partly or wholly of
            # none taken as the examples' while the losses confirm it: ``policy.assumable``;
            # a layout made only of owners >= 0; else the fallback), so another batch's
            # mask leaves the program's rows right (``tests/engine/analysis/test_masked_fill``)
            o[args[1].expand(x.shape)] = v.reshape(()).to(o.device)
            o = self._apart(o, self.selector(args[1]))  # elements kept by another's mask
            if bool((self.owner(x) == NONE).all()):  # no example's: what the mask made it
                o = combine(o, self.selector(args[1])).expand(x.shape)
        else:  # __setitem__
            o = self._put(x, args[1], v)
        return self._set(x, shrink(o), self._crossing(name, origin))

    def _placed(self, name: str, args: tuple, kwargs: dict) -> Tensor:
        """The owners of ``x`` after ``masked_scatter(mask, source)``, ``index_add(dim, index,
        source)`` or ``index_copy(dim, index, source)``, in place or not."""
        x = args[0]
        if name.startswith("masked_scatter"):  # source's elements, in order, where mask holds
            mask, source = (*args[1:], *(kwargs[k] for k in ("mask", "source") if k in kwargs))
            o = self.owner(x).expand(x.shape).clone()
            o.masked_scatter_(mask.expand(x.shape), self.owner(source).expand(source.shape))
            return combine(shrink(o), self.owner(mask))  # the mask placed them: its owners too
        # index_add(dim, index, source, alpha=1): rows index[j] of x gain source's row j;
        # index_copy: they become source's row j
        dim, index, source = (
            *args[1:],
            *(kwargs[k] for k in ("dim", "index", "source") if k in kwargs),
        )[:3]
        dim = dim % x.dim()
        rest = [d for d in range(x.dim()) if d != dim]
        base = reduce(self.owner(x), rest).reshape(-1).expand(x.shape[dim]).clone()
        rows = reduce(self.owner(source), [d for d in range(source.dim()) if d != dim])
        rows = rows.reshape(-1).expand(index.shape[0])
        if name.startswith("index_copy"):
            o = base.index_copy(0, index, rows.contiguous())
        else:
            o = segment_combine(base, index, rows)
        shape = [1] * x.dim()
        shape[dim] = x.shape[dim]
        return compact(self._rows_placed(o.view(shape), dim, index))
