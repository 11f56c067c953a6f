"""Which example each row of a tensor is, followed op by op through a routed region's forward
(``routed.py``): for every tensor made from the region's arguments, an (n,) tensor on the device
giving the example of each row along dimension 0 (``NO_ONE`` for a row of no example).

- Rows move with the values that pick them (``x[idx]``, ``index_select``, ``index_add``, a
  boolean mask's picks and writes: ``masked.py``); the index tensors themselves are positions
  (sorts', ``arange``'s, as the trace takes them), unless computed from an example's values,
  whose rows then join.
- Ops that keep rows keep them: elementwise ops, casts, row-by-row products with weights of no
  example, views and reductions off dimension 0, reshapes that split rows or merge whole ones;
  views that move dimension 0 elsewhere lay the rows along another (``moved.py``).
- Rows that meet (two operands, rows merged, rows written to one place) must be one example's,
  or no example's: what the batch's values decide there is a flag on the device, kept until the
  forward's end, when the replay reads them all at once (``bad``).
- Any other op on a followed tensor, or an in-place write into a view or through one, leaves
  its results unfollowed (``None``), with the op's name in ``lost``.
- Where the ops say which example each row is by its position alone (``forms.py``: a sort's
  permutation, its inverse, ``arange``), the rows keep that form, and a flag that rows of one
  form would settle is not raised.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..analysis.selectors import unique_ids
from ..ops import FILLS, POSITIONS, WRITES_IN_PLACE
from ..tensors import tensors_in
from .forms import INV, PICK, REP, Form, Maps, picked
from .moved import Along
from .rowops import NO_ONE, rows_after


class RowFlow:
    """The rows of one region call's tensors, by id (the tensor kept beside them: an id is
    only its tensor's while it lives), and the dimension they lie along; a tensor not here is
    no example's."""

    def __init__(self, batch: int):
        self.batch = batch
        self.rows: dict[int, tuple[Tensor, Tensor | None, int]] = {}
        self.along = False  # whether any tensor's rows lay along another dimension than 0
        self.wrong: list[Tensor] = []  # flags, each (n,) or (): any true fails the batch
        self.lost: str | None = None  # the first op whose results could not be followed
        # by id, kept alive so that no id is another's: the forms of rows tensors, and of the
        # index tensors (None: made here, its values unknown), and the permutations they name
        self.forms: dict[int, tuple[Tensor, Form]] = {}
        self.indices: dict[int, tuple[Tensor, Maps | None]] = {}
        self.held: list[Tensor] = []
        self.spoiled: set[int] = set()  # permutations written or viewed since: no form names one
        # rows laid out by a packed sequence's slots (``packrows.py``): rows, its batch sizes,
        # and each slot's example, by id of the rows
        self.slotted: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def lane(self, t: Tensor, spec: tuple) -> Tensor | None:
        """The rows of the batch along dimension 0 of ``t``, (r // m) % B; None along another."""
        dim, m = spec
        if dim != 0 or t.dim() == 0:
            return None
        rows = _lane(t.shape[0], m, self.batch, t.device)
        self.formed(rows, (m, ()))
        return rows

    def formed(self, rows: Tensor, form: Form | None) -> Tensor:
        """``rows``, of ``form`` where it has one."""
        if form is not None:
            self.forms[id(rows)] = (rows, form)
        return rows

    def form(self, rows: object) -> Form | None:
        item = self.forms.get(id(rows))
        form = item[1] if item is not None and item[0] is rows else None
        return None if form is None or self._spoiled(form[1]) else form

    def maps(self, index: object) -> Maps | None:
        """An index tensor's form: its value at each position, by the position alone."""
        item = self.indices.get(id(index))
        maps = item[1] if item is not None and item[0] is index else None
        return None if maps is None or self._spoiled(maps) else maps

    def _spoiled(self, maps: Maps) -> bool:
        return bool(self.spoiled) and any(m[1] in self.spoiled for m in maps if m[0] != REP)

    def settled(self, rows: Tensor, form: Form) -> bool:
        """Whether ``rows`` are of ``form`` whatever the batch's values."""
        return self.form(rows) == form

    def keep(self, t: object, rows: Tensor | Along | None | bool) -> None:
        """``t``'s rows (None: unfollowed; False: no example's, as a tensor never seen)."""
        if not isinstance(t, Tensor):
            return
        if rows is False:
            self.rows.pop(id(t), None)
        elif isinstance(rows, Along):
            self.rows[id(t)], self.along = (t, rows.rows, rows.dim), True
        else:
            self.rows[id(t)] = (t, rows, 0)

    def of(self, t: object) -> Tensor | None | bool:
        """``t``'s rows along dimension 0; None where unfollowed, or along another; False where
        it is no example's."""
        at = self.at(t)
        return at if not isinstance(at, tuple) else None if at[1] else at[0]

    def at(self, t: object) -> tuple[Tensor, int] | None | bool:
        """``t``'s rows and the dimension they lie along; None where unfollowed; False where
        it is no example's."""
        item = self.rows.get(id(t)) if isinstance(t, Tensor) else None
        if item is None or item[0] is not t:
            return False
        return None if item[1] is None else item[1:]

    def off(self, t: object) -> bool:
        """Whether ``t``'s rows lie along another dimension than 0."""
        at = self.at(t)
        return isinstance(at, tuple) and at[1] > 0

    def picked(self, rows: Tensor, index: Tensor) -> Tensor:
        """The rows an index tensor of no example picks, of a form where both have one."""
        form, maps = self.form(rows), self.maps(index)
        return self.formed(
            rows[index], None if form is None or maps is None else picked(maps, form)
        )

    def flag(self, wrong: Tensor) -> None:
        """The batch is not one the replay can serve where any of ``wrong`` holds."""
        self.wrong.append(wrong.reshape(-1))

    @property
    def bad(self) -> Tensor | None:
        """Whether any flag holds: one op over them all, on the device; None with no flag."""
        if not self.wrong:
            return None
        return (self.wrong[0] if len(self.wrong) == 1 else torch.cat(self.wrong)).any()

    def combine(self, rows: list[Tensor]) -> Tensor:
        """Rows from several tensors at one position: one example's, or no example's."""
        out = rows[0]
        form = self.form(out)
        if form is not None and all(self.form(r) == form for r in rows[1:]):
            return out  # equal on every batch
        for r in rows[1:]:
            if r is out:
                continue
            self.flag((out != r) & (out != NO_ONE) & (r != NO_ONE))
            out = torch.maximum(out, r)
        return out

    def lose(self, name: str, out: object) -> None:
        self.lost = self.lost or name
        for t in out if isinstance(out, (tuple, list)) else (out,):
            self.keep(t, None)

    def _aliased(self, x: Tensor) -> bool:
        """Whether ``x`` is a view, or a followed tensor is a view of it."""
        if x._base is not None:
            return True
        return any(t is not x and t._base is x for t, *_ in self.rows.values())

    def follow(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        """The rows of ``out``, the result of op ``name`` on followed tensors."""
        if name in FILLS or name in POSITIONS or (name == "where" and len(args) == 1):
            return
        if name == "unique" and unique_ids(args, kwargs, out):
            return
        x = args[0] if args else None
        if name == "sort" and isinstance(out, tuple) and x.dim() == 1:  # a permutation
            self.held.append(out[1])
            self.indices[id(out[1])] = (out[1], ((PICK, id(out[1])),))
        in_place = name.endswith("_") and not name.endswith("__")
        in_place = in_place or name == "__setitem__" or name.startswith("__i")
        target = x if in_place else out
        rows = rows_after(self, name, args, kwargs, out)
        if in_place and isinstance(x, Tensor) and rows is not self.of(x) and self._aliased(x):
            # a view's rows, or its base's, would not see the write: none of them is followed
            return self.lose(name, [t for t, *_ in list(self.rows.values()) if _alias(t, x)])
        if rows is NotImplemented:
            return self.lose(name, target)
        if isinstance(rows, tuple) and not isinstance(rows, Along):
            for t, r in zip(out, rows, strict=True):
                self.keep(t, r)
            return
        self.keep(target, rows)

    def iota(self, args: tuple, kwargs: dict, out: Tensor) -> None:
        """``torch.arange(n)`` (or from 0 by 1) of integers: each position's value itself."""
        if not 0 < len(args) < 4 or not set(kwargs) <= {"dtype", "device"}:
            return
        start, _, step = (0, *args, 1)[-3:] if len(args) == 1 else (*args, 1)[:3]
        if start == 0 and step == 1 and not out.is_floating_point() and out.dim() == 1:
            self.indices[id(out)] = (out, ())

    def indexing(self, name: str, args: tuple, kwargs: dict, out: object) -> None:
        """The forms of index tensors after op ``name`` on one of them: ``P // k``, a tensor
        made like one, ``inv[P] = arange(n)`` (P's inverse); a write into one, or a view of
        one, leaves its values unknown."""
        x = args[0] if args else None
        if name == "__setitem__" and self._inverse(*args[:3]):
            return
        maps = self.maps(x)
        k = args[1] if len(args) > 1 else None
        if name in ("__floordiv__", "floor_divide") and maps is not None and type(k) is int:
            if k > 0 and isinstance(out, Tensor):
                self.indices[id(out)] = (out, (*maps, (REP, k)))
        elif name in ("empty_like", "new_empty") and isinstance(out, Tensor):
            self.indices[id(out)] = (out, None)
        written = name in WRITES_IN_PLACE or (name.endswith("_") and not name.endswith("__"))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if type(t) is Tensor]
        for t in tensors_in(args, kwargs):
            if id(t) in self.indices and ((written and t is x) or any(_alias(o, t) for o in outs)):
                self.indices.pop(id(t))
                if any(p is t for p in self.held):  # the forms that name it no longer hold
                    self.spoiled.add(id(t))

    def _inverse(self, x: object, key: object, value: object) -> bool:
        """``x[P] = arange(n)`` for a permutation P of x's n positions: x is P's inverse."""
        item = self.indices.get(id(x))
        p = self.maps(key)
        if item is None or item[0] is not x or p is None or len(p) != 1 or p[0][0] != PICK:
            return False
        if self.maps(value) != () or x.dim() != 1 or x.is_floating_point():
            return False
        if not (x.shape == key.shape == value.shape):
            return False
        self.indices[id(x)] = (x, ((INV, p[0][1]),))
        return True


def _alias(out: Tensor, t: Tensor) -> bool:
    """Whether ``out`` shares ``t``'s memory."""
    return out is t or out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


@functools.lru_cache(maxsize=256)
def _lane(n: int, m: int, batch: int, device: torch.device) -> Tensor:
    """(r // m) % B for each of n rows: made once, as every replayed batch of a signature asks
    the same (rows tensors are never written in place: each op on them makes new ones)."""
    return torch.arange(n, device=device) // m % batch
