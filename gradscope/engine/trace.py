"""Which example every row belongs to: owner tensors traced through the forward, op by op.

A torch function mode sees each op the model runs. The batch's inputs and targets start with row
i owned by example i; each op's output gets owners computed from its inputs' (``owners.py``):
views and moves of rows (reshape, transpose, index, gather, masks, cat, split) by applying the
same op to the owners, elementwise ops by combining them, reductions and contractions (softmax,
norms, matmul, linear, conv, attention) by reducing them over the dimensions they mix. An op it
does not know keeps dimension 0's owners (the engine's assumption before this trace, which the
first batch's self-check verifies) and is named in ``unknown``. A rule then reads each call's
rows through its owners: rows of one example each, in any layout, are exact; a row of several
examples, or of none, sends the parameter to the fallback with the op that made it.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .lanes import Lane, after
from .ops import (
    CASTS,
    CONTRACTIONS,
    CREATIONS,
    ELEMENTWISE,
    IN_PLACE_MOVES,
    IN_PLACE_OPERATORS,
    INDICES,
    MOVES,
    PLACES,
    READS,
    REDUCTIONS,
    RESHAPES,
    SCATTERS,
    SORTS,
    ZEROING,
    binary,
    dims_of,
    filled,
    op_name,
    tensors_in,
)
from .owners import (
    MIXED,
    NONE,
    combine,
    compact,
    is_batch,
    reduce,
    reshaped,
    scatter_combine,
    segment_combine,
    shrink,
)


class ByTensor:
    """tensor -> value, by identity, keeping no tensor alive (a pass's many intermediates)."""

    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, object]] = {}

    def get(self, t: object, default: object = None) -> object:
        item = self._items.get(id(t))
        return item[1] if item is not None and item[0]() is t else default

    def __contains__(self, t: object) -> bool:  # once per op and argument: one lookup, no call
        item = self._items.get(id(t))
        return item is not None and item[0]() is t

    def found_in(self, values: tuple | list) -> list[tuple[int, object]]:
        """(position, value) of each of ``values`` held: once per op, so no call per value."""
        items, hits = self._items, []
        for k, t in enumerate(values):
            item = items.get(id(t))
            if item is not None and item[0]() is t:
                hits.append((k, item[1]))
        return hits

    def held(self, args: tuple, kwargs: dict) -> list[tuple[Tensor, object]]:
        """(tensor, value) of each tensor held among an op's arguments and in its list
        arguments: once per op, the lookups and the values in one pass."""
        items, hits = self._items, []
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                item = items.get(id(t))
                if item is not None and item[0]() is t:
                    hits.append((t, item[1]))
        return hits

    def __getitem__(self, t: object) -> object:
        return self.get(t)

    def __setitem__(self, t: Tensor, value: object) -> None:
        self._items[id(t)] = (weakref.ref(t), value)


@functools.lru_cache(maxsize=1024)
def _lane_tensor(shape: tuple[int, ...], dim: int, m: int, batch: int, device) -> Tensor:
    """The owners (i // m) % B along ``dim``, one tensor for every pass of a model: owner
    tensors are never edited in place (the algebra copies before it writes)."""
    i = torch.arange(shape[dim], device=device)
    return (i // m % batch).view(shape)


class RowTrace(TorchFunctionMode):
    """Traces owners through one forward of a batch of ``batch`` examples."""

    def __init__(self, batch: int, tensors: tuple[Tensor, ...]):
        super().__init__()
        self.batch = batch
        self.owners = ByTensor()
        self.unknown: dict[str, None] = {}  # ops seen on batch tensors whose owners were assumed
        self.mixed_by = ByTensor()  # tensor -> the op that mixed examples on its way
        self._lanes: dict[object, Tensor] = {}  # (rank, dim, size, m) -> its owners
        self._lane_of: dict[int, tuple[Tensor, Lane]] = {}  # id of those owners -> the lane
        first = next((t for t in tensors if isinstance(t, Tensor)), None)
        self.device = first.device if first is not None else torch.device("cpu")
        for t in tensors:
            if isinstance(t, Tensor) and t.dim() and t.shape[0] == batch:
                self.owners[t] = self.standard(t.dim())

    def standard(self, rank: int) -> Tensor:
        """(B, 1, ..., 1): row i of dimension 0 is example i's, the same tensor every time."""
        return self._lane_owners(rank, (0, 1), self.batch)

    def _lane_owners(self, rank: int, lane: Lane, size: int) -> Tensor:
        """The owners of ``lane`` (``lanes.py``) on a dimension of ``size``, the same tensor
        every time (with B = 1, (1, ..., 1) zeros whatever the lane: every element is one's)."""
        dim, m = lane
        key = (rank, dim, size, m) if self.batch > 1 else rank
        o = self._lanes.get(key)
        if o is None:
            shape = [1] * rank
            shape[dim] = size if self.batch > 1 else 1
            o = self._lanes[key] = _lane_tensor(tuple(shape), dim, m, self.batch, self.device)
            self._lane_of[id(o)] = (o, lane if self.batch > 1 else (0, 1))
        return o

    def lane(self, o: object) -> Lane | None:
        """The lane ``o`` is the owners of, if it is one of ``_lane_owners``' tensors."""
        item = self._lane_of.get(id(o))
        return item[1] if item is not None and item[0] is o else None

    def is_standard(self, o: Tensor) -> bool:
        """Whether ``o`` is ``standard``'s tensor: one row per example, known without a compare."""
        return o is self._lanes.get((o.dim(), 0, self.batch, 1) if self.batch > 1 else o.dim())

    def per_example(self, t: Tensor, batch: int) -> bool:
        """``is_batch`` of ``t``'s owners (the losses'), known without a compare where they
        are ``standard``'s tensor."""
        o = self.owner(t)
        return (batch == self.batch and self.is_standard(o)) or is_batch(o, batch)

    def one_row_each(self, x: Tensor, owners: Tensor, features: int) -> bool:
        """Whether ``x`` is (B, *features) or (B, T, *features), not empty, with ``x[i]``
        example i's by ``owners`` being ``standard``'s tensor: a row-by-row rule reads it as it
        is, the (B, L, *features) the gather would give (an empty one is gathered; with B = 1,
        (1, 1) owners may describe any number of rows)."""
        rows = x.dim() - features
        shaped = 0 < rows <= 2 and x.shape[0] == self.batch and x.numel() > 0
        return shaped and self.is_standard(owners)

    def owner(self, t: Tensor) -> Tensor:
        """``t``'s owners, ``NONE`` everywhere for a tensor not computed from the batch."""
        o = self.owners.get(t)
        return o if o is not None else filled(t, NONE)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__ == "__get__" and func.__self__.__name__ not in ("T", "mT", "data"):
            return func(*args, **kwargs)  # a property: metadata, or a view handled as an op
        name = op_name(func)
        if name in READS:
            return func(*args, **kwargs)
        if name == "__iter__" and args and args[0] in self.owners:
            rows = args[0].unbind(0)  # for row in x: the rows of unbind(0)
            self._record("unbind", torch.unbind, args[:1], {}, rows)
            return iter(rows)
        out = func(*args, **kwargs)
        self._record(name, func, args, kwargs, out)
        return out

    def _record(self, name: str, func, args: tuple, kwargs: dict, out: object) -> None:
        """The owners of ``out``, the result of op ``name``; never an error in the user's
        forward: owners that cannot be followed are MIXED (the parameters they reach go to the
        fallback)."""
        tracked = self.owners.held(args, kwargs)  # (tensor, its owners)
        if not tracked:
            return
        origin = name
        try:
            if self._by_lanes(name, args, kwargs, tracked, out):
                return
            origin = next((self.mixed_by[t] for t, _ in tracked if t in self.mixed_by), name)
            self._follow(name, func, args, kwargs, out, origin)
        except Exception:  # owners could not follow this op: its results mix examples
            self._set(out, None, origin)

    def _by_lanes(self, name: str, args: tuple, kwargs: dict, tracked: list, out) -> bool:
        """The common case at the cost of a few comparisons: every tracked input's owners a
        lane (the batch along one dimension) and an op that keeps one (``lanes.after``).
        Anything else is left to ``_follow``. Loops, not generators: this runs on every op."""
        lanes, lane_of = {}, self._lane_of
        for t, o in tracked:
            item = lane_of.get(id(o))
            if item is None or item[0] is not o:
                return False
            lanes[id(t)] = item[1]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if not isinstance(t, Tensor) or not t.numel():
                return False
        lane = after(name, args, kwargs, lanes, outs[0], self.batch) if outs else None
        if lane is None:
            return False
        dim, m = lane
        for t in outs:
            if t.dim() <= dim or t.shape[dim] % (self.batch * m):
                return False
        for t in outs:
            self.owners[t] = self._lane_owners(t.dim(), lane, t.shape[dim])
        return True

    def mixed_at(self, t: Tensor) -> str | None:
        """The op that first mixed examples on the way to ``t``, if any did."""
        return self.mixed_by.get(t)

    # -- one op ---------------------------------------------------------------------------

    def _set(self, out: object, owner: Tensor | tuple | None, origin: str) -> None:
        """Record ``owner`` for each tensor of ``out`` (None: MIXED everywhere); ``origin``
        names the op that mixed examples, where the owners say some did."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        owners = owner if isinstance(owner, (tuple, list)) else (owner,) * len(outs)
        for t, o in zip(outs, owners, strict=False):
            if not isinstance(t, Tensor):
                continue
            if t.numel() == 0:  # no element to belong to anyone
                o = filled(t, NONE)
            elif o is None or o.dim() != t.dim():
                o = filled(t, MIXED)
            o = compact(o)
            if o.dim() and o.numel() == self.batch == o.shape[0] and is_batch(o, self.batch):
                o = self.standard(t.dim())  # the canonical tensor: later ops take the fast path
            elif bool((o == MIXED).any()):
                self.mixed_by[t] = origin
            self.owners[t] = o

    def _follow(self, name: str, func, args: tuple, kwargs: dict, out: object, origin: str):
        if name in INDICES and len(args) == 1:  # positions, not values: nothing flows back
            outs = out if isinstance(out, (tuple, list)) else (out,)  # as_tuple: one per dim
            return self._set(out, tuple(filled(t, NONE) for t in outs), origin)
        if name in CREATIONS:
            return self._set(out, filled(out, NONE), origin)
        if name in SORTS:
            return self._set(out, self._sorted(name, args, kwargs, out), origin)
        if name in PLACES:  # in place or not
            target = args[0] if name.endswith("_") else out
            return self._set(target, self._placed(name, args, kwargs), origin)
        if name in IN_PLACE_MOVES:
            return self._in_place(name, args, kwargs, origin)
        if name in SCATTERS:
            return self._scatter(name, args, kwargs, out, origin)
        if name in IN_PLACE_OPERATORS and isinstance(args[0], Tensor):  # x += y
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
            return self._set(out, self._move(func, args, kwargs, name in ZEROING), origin)
        if name == "as_strided":
            return self._set(out, self._strided(args, kwargs), origin)
        if name in ELEMENTWISE or binary(name, args, kwargs):
            return self._set(out, combine(*self._all(args, kwargs)), origin)
        if name in CASTS:  # the other tensor gives only a dtype
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
        result = func(full(args[0]), *args[1:], **kwargs)
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
        o = shrink(scatter_combine(base, dim, index, values.contiguous(), keep))
        self._set(x if name.endswith("_") else out, o, origin)

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
            o[args[1].expand(x.shape)] = v.reshape(()).to(o.device)
        else:  # __setitem__
            o[args[1]] = v.expand(o[args[1]].shape) if v.dim() else v.to(o.device)
        return self._set(x, shrink(o), origin)

    def _placed(self, name: str, args: tuple, kwargs: dict) -> Tensor:
        """The owners of ``x`` after ``masked_scatter(mask, source)`` or ``index_add(dim,
        index, source)``, in place or not."""
        x = args[0]
        if name.startswith("masked_scatter"):  # source's elements, in order, where mask holds
            mask, source = (*args[1:], *(kwargs[k] for k in ("mask", "source") if k in kwargs))
            o = self.owner(x).expand(x.shape).clone()
            o.masked_scatter_(mask.expand(x.shape), self.owner(source).expand(source.shape))
            return combine(shrink(o), self.owner(mask))  # the mask placed them: its owners too
        # index_add(dim, index, source, alpha=1): rows index[j] of x gain source's row j
        dim, index, source = (
            *args[1:],
            *(kwargs[k] for k in ("dim", "index", "source") if k in kwargs),
        )[:3]
        dim = dim % x.dim()
        rest = [d for d in range(x.dim()) if d != dim]
        base = reduce(self.owner(x), rest).reshape(-1).expand(x.shape[dim]).clone()
        rows = reduce(self.owner(source), [d for d in range(source.dim()) if d != dim])
        rows = rows.reshape(-1).expand(index.shape[0])
        o = segment_combine(base, index, rows)
        shape = [1] * x.dim()
        shape[dim] = x.shape[dim]
        return compact(o.view(shape))
