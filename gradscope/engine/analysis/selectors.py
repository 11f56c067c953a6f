"""The owners of the values that pick elements: a boolean mask's (``x[mask]``, ``x[mask] = y``,
``masked_select``), whose value at an element says whether it goes on, and an integer index's
(``x[idx]``), whose value at a position says which element lands there. An element of example a
that example b's values pick depends on both (a mask shifted along the rows, flipped, summed
over them: examples that are not separable, whatever the batch's sum of gradients says), so
the trace makes its owner MIXED; a selector of no example's, or of the element's own, keeps it.
So do an index along the features or positions (``h.gather(2, idx)``, ``h[:, :, idx]``) and
the writes an index places (``scatter`` and its kin, ``x[idx] = y``, ``index_put``,
``index_add``): every example has those dimensions alike, but which element lands where is
still the index's values'. An element of no example's that one example's index picks or places
(a table's row, a -inf mask's zeros) becomes that example's; a sort's indices along a dimension
of one owner are that owner's values.

The selectors' owners are the owner algebra's, but for two kinds of values that pick without
being any example's, as the replay's row flow takes them (``replay/rowflow.py``): the ids of
the experts a batch routes to (``x.unique()`` of integers, Ergo's loop: a mask ``ids == e``
says which rows' own ids route them to e, and the loop over every id routes every row), and
the positions where a mask holds (``nonzero``), which are its values' at those positions; while
every one of them is taken (``hits.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import ELEMENTWISE, INDICES, MOVES, RESHAPES, SORTS, ZEROING
from ..tensors import tensors_in
from .arguments import binary, filled
from .hits import WHOLE, moved
from .keys import masks, span, taken
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
from .routes import ID


def unique_ids(args: tuple, kwargs: dict, out: object) -> bool:
    """``x.unique()`` of integers alone (the experts a batch routes to, Ergo's loop): ids, as
    ``nonzero``'s positions are; with inverse indices or counts, each row's, not ids."""
    x = args[0] if args else None
    extra = (kwargs.get(k) for k in ("return_inverse", "return_counts", "dim"))
    alone = (
        isinstance(out, Tensor)
        and len(args) <= 2
        and not any(e is not None and e is not False for e in extra)
    )
    return alone and isinstance(x, Tensor) and not x.is_floating_point() and not x.is_complex()


class Selectors:
    """Part of ``OwnerAlgebra``: uses its ``owner``, ``_varies`` and ``selectors`` (tensor ->
    the owners of its values as a selector, where they differ from ``owner``'s)."""

    crossed = False  # whether the op just followed picked elements by another example's values
    slabbed = False  # whether such ids picked a slab (``analyse.py`` checks every example)
    hits = None  # ids the batch hit (``nonzero``'s, ``unique``'s) -> ``hits.py``'s WHOLE or ONE

    def selector(self, t: Tensor) -> Tensor:
        """The owners of ``t``'s values as a selector (``owner``'s unless noted otherwise)."""
        o = self.selectors.get(t)
        return o if o is not None else self.owner(t)

    def _selects(self, name: str, func, args: tuple, kwargs: dict, out: object) -> None:
        """Notes the selector owners of ``out`` where they differ from its owners: ids, the
        positions of a mask's elements, and elementwise ops, moves and reshapes of them."""
        self.crossed = False
        if name == "unique" and unique_ids(args, kwargs, out):
            self.selectors[out] = filled(out, NONE)
            self._hit(out, WHOLE)
            return
        if name in SORTS and isinstance(args[0], Tensor):
            order = out if name == "argsort" else out[1]
            self.selectors[order] = self._order(args, kwargs, order)
            return
        if name in INDICES and len(args) == 1 and isinstance(args[0], Tensor):
            x = args[0]
            at = self.selector(x).expand(x.shape)[x.bool()]  # (n,) in nonzero's order
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                self.selectors[t] = compact(at.reshape(-1, *([1] * (t.dim() - 1))))
                self._hit(t, WHOLE)
            return
        if not any(t in self.selectors for t in tensors_in(args, kwargs)):
            return
        x, outs = args[0], out if isinstance(out, (tuple, list)) else (out,)
        hit = self.hits.get(x) if self.hits is not None else None  # moved, ids; computed on, not
        if name in ELEMENTWISE or binary(name, args, kwargs):
            found, hit = (combine(*(self.selector(t) for t in tensors_in(args, kwargs))),), None
        elif name in RESHAPES and isinstance(x, Tensor):
            found = (reshaped(self.selector(x), x.shape, out.shape),)
        elif name in MOVES and name not in ZEROING and x in self.selectors:
            found = func(self.selector(x).expand(x.shape), *args[1:], **kwargs)
            found = found if isinstance(found, (tuple, list)) else (found,)
        else:
            return
        for t, o in zip(outs, found, strict=False):
            if isinstance(t, Tensor) and o is not None and o.dim() == t.dim():
                kept = hit if hit != WHOLE else moved(name, args, kwargs, x, t)
                if hit is not None and kept is None:  # some of the hits: the batch's first
                    o = torch.where(o == NONE, MIXED, o)
                self.selectors[t] = shrink(o)
                self._hit(t, kept)

    def _hit(self, t: Tensor, state: str | None) -> None:
        """Notes ``t`` as ids the batch hit (``hits.py``: WHOLE, ONE), where ``state`` is."""
        if state is not None:
            if self.hits is None:
                self.hits, self.routes = type(self.selectors)(), type(self.selectors)()
            self.hits[t], self.routes[t] = state, ID  # an id, whose slabs meet (``routes.py``)

    def _order(self, args: tuple, kwargs: dict, order: Tensor) -> Tensor:
        """The selector owners of a sort's indices ``order``: along a dimension of one owner,
        that line's values (an example's argsort of its own features is its own; of another
        example's, another's); along rows of several, positions, no example's (the trace moves
        the rows' owners as the values pick them: ``_sorted``)."""
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
        if self._varies(x, [dim]):
            return filled(order, NONE)
        return compact(reduce(self.owner(x), [dim]))

    def _apart(self, o: Tensor, sel: Tensor) -> Tensor:
        """``o`` MIXED where the selector's owners ``sel`` (broadcast) are another example's;
        ``crossed`` set where any is."""
        crossed = (sel != NONE) & (o != NONE) & (sel != o)
        if not bool(crossed.any()):
            return o
        self.crossed = True
        return torch.where(crossed, MIXED, o)

    def _slab(self, x: Tensor, dims: list[int], index: Tensor) -> Tensor:
        """``index``'s selector owners into ``x`` along ``dims``, with MIXED taken as no
        example's where the index holds ids a mask of the batch hit (``hits``) and ``x`` is a
        parameter, or holds integers or booleans of one owner along ``dims``: a slab every
        example shares, as a loop over every expert id the batch's routing hit takes Mixtral's
        ``W[e]`` and ``mask[e]``. One example's index there still crosses, and so do an index
        of values the batch mixed (``W[x.sum(0).argmax()]``: example i's output another's
        values pick) and an index of several into values or a table of no example's. Which
        ids a loop visits is the batch's (Python's, not the trace's), so ``slabbed`` asks the
        analysis to check every example alone (a sum over every hit expert's ``W[e]``)."""
        sel = self.selector(index)
        if self.hits is None or index not in self.hits:
            return sel
        shared = isinstance(x, torch.nn.Parameter)
        if not shared and (x.is_floating_point() or x.is_complex() or self._varies(x, dims)):
            return sel
        self.slabbed = True
        return torch.where(sel == MIXED, NONE, sel)

    def _by_index(self, o: Tensor, sel: Tensor) -> Tensor:
        """``_apart`` for an integer index: ``o`` MIXED where the index that picked or placed an
        element is another example's, and an element of no example's that an index of the
        batch's values picked or placed its owners' (a table's row, a -inf mask's zeros, put
        where one example's values say, that example's; where several's, MIXED)."""
        o = self._apart(o, sel)
        return torch.where((o == NONE) & (sel != NONE), sel, o)

    def _crossing(self, name: str, origin: str) -> str:
        """The origin of op ``name``'s MIXED owners: the op itself, and the module whose call
        ran it, where it picked or placed elements by another example's values; else
        ``origin``."""
        if not self.crossed:
            return origin
        self.crossed = False
        stack = self.finder.stack if self.finder is not None else []
        at = stack[-1].module if stack else None
        path = next((n for n, m in self.finder.model.named_modules() if m is at), "") if at else ""
        return f"{name}, picked by another example's values{f' in {path}' if path else ''}"

    def _masked(self, x: Tensor, key: object, o: Tensor) -> Tensor:
        """``o`` (owners of x's elements, or of what a write leaves there, full-shaped) MIXED
        where a boolean mask in ``key`` (``x[key]``, ``x[key] = y``) is another example's."""
        for at, mask in masks(key, x.dim()):
            om = self.selector(mask)  # (mask's shape), broadcastable
            if not bool((om == NONE).all()):
                om = om.reshape(*([1] * at), *om.shape, *([1] * (x.dim() - at - mask.dim())))
                o = self._apart(o, om)
        return o

    def _took(self, args: tuple, kwargs: dict) -> Tensor:
        """The owners of ``x.take(index)``: x's flattened, picked, taken by ``_by_index``."""
        x, index = args[0], kwargs.get("index", args[1] if len(args) > 1 else None)
        o = self.owner(x).expand(x.shape).take(index)
        return shrink(self._by_index(o, self.selector(index)))

    def _put(self, x: Tensor, key: object, v: Tensor) -> Tensor:
        """The owners of ``x`` (full-shaped) after ``x[key] = value``, ``v`` the value's."""
        o = self.owner(x).expand(x.shape).clone()
        o[key] = v.expand(o[key].shape) if v.dim() else v.to(o.device)
        o = self._masked(x, key, o)
        o[key] = self._indexed(x, key, o[key])
        return o

    def _index_put(self, args: tuple, kwargs: dict) -> Tensor | None:
        """The owners of ``x.index_put(indices, values)``, as ``x[indices] = values`` gives
        them; None (MIXED) where it accumulates, or an entry of ``indices`` is None."""
        x = args[0]
        key = kwargs.get("indices", args[1] if len(args) > 1 else None)
        value = kwargs.get("values", args[2] if len(args) > 2 else None)
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        keyed = isinstance(key, (tuple, list)) and all(isinstance(k, Tensor) for k in key)
        if accumulate or not keyed:
            return None
        v = self.owner(value) if isinstance(value, Tensor) else torch.tensor(NONE)
        return shrink(self._put(x, tuple(key), v))

    def _indexed(self, x: Tensor, key: object, o: Tensor) -> Tensor:
        """``o``, the owners of ``x[key]``, MIXED where the integer indices in ``key`` that
        picked an element are another example's (one index tensor, or several side by side)."""
        key = key if isinstance(key, tuple) else (key,)
        spots = [i for i, k in enumerate(key) if isinstance(k, Tensor)]
        if not spots or any(key[i].dtype == torch.bool for i in spots):
            return o
        dims = taken(key, x.dim(), spots)
        sel = combine(*(self._slab(x, dims, key[i]) for i in spots))  # (the indices' shape)
        if bool((sel == NONE).all()):
            return o
        if spots != list(range(spots[0], spots[-1] + 1)):
            place = 0  # apart: torch puts the indexed dimensions first
        else:
            place = sum(span(k, x.dim(), key) for k in key[: spots[0]] if not isinstance(k, int))
        sel = sel.reshape(*([1] * place), *sel.shape, *([1] * (o.dim() - place - sel.dim())))
        return self._by_index(o, sel)

    def _along(self, name: str, args: tuple, kwargs: dict, o: Tensor) -> Tensor:
        """``o``, the owners of ``x.index_select(dim, index)``, ``x.gather(dim, index)`` or
        ``x.take_along_dim(index, dim)``, taken by ``_by_index``: MIXED where the index that
        picked an element is another example's, whatever the dimension (a feature picked by
        another example's argmax is as crossed as a row)."""
        x, rest = args[0], args[1:]
        if name == "take_along_dim":
            index, dim = (*rest, None, None)[:2]
            index, dim = kwargs.get("indices", index), kwargs.get("dim", dim)
        else:
            dim, index = (*rest, None, None)[:2]
            dim, index = kwargs.get("dim", dim), kwargs.get("index", index)
        if not isinstance(index, Tensor) or not isinstance(dim, int):
            return o
        sel = self._slab(x, [dim], index)
        if bool((sel == NONE).all()):
            return o
        if name == "index_select":  # (n,) along dim
            d = dim % x.dim()
            sel = sel.reshape(*([1] * d), -1, *([1] * (x.dim() - d - 1)))
        return self._by_index(o, sel)

    def _scattered(self, o: Tensor, dim: int, index: Tensor) -> Tensor:
        """``o`` (full-shaped), the owners of ``x.scatter(dim, index, src)`` or its kin, taken
        by ``_by_index`` with the selectors of the index entries that landed on each element."""
        sel = self.selector(index)
        if bool((sel == NONE).all()):
            return o
        at = torch.full(o.shape, NONE, dtype=torch.long, device=o.device)
        at = scatter_combine(at, dim, index, sel.expand(index.shape).contiguous(), True)
        return self._by_index(o, at)

    def _rows_placed(self, o: Tensor, dim: int, index: Tensor) -> Tensor:
        """``o`` (x's rank, x's length along ``dim``, 1 elsewhere), the owners of
        ``x.index_add(dim, index, source)`` or ``index_copy``, taken by ``_by_index`` with the
        selectors of the index entries that placed each slice along ``dim``."""
        sel = self.selector(index)
        if bool((sel == NONE).all()):
            return o
        none = torch.full((o.shape[dim],), NONE, dtype=torch.long, device=o.device)
        at = segment_combine(none, index, sel.expand(index.shape).contiguous())
        return self._by_index(o, at.view(o.shape))
