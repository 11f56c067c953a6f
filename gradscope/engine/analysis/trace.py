"""Which example every row belongs to: owner tensors traced through the forward, op by op.

A torch function mode sees each op the model runs. The batch's inputs and targets start with row
i owned by example i; each op's output gets owners computed from its inputs' (``owners.py``):
views and moves of rows (reshape, transpose, index, gather, masks, cat, split) by applying the
same op to the owners, elementwise ops by combining them, reductions and contractions (softmax,
norms, matmul, linear, conv, attention) by reducing them over the dimensions they mix. An op it
does not know keeps dimension 0's owners (the engine's assumption before this trace, which the
self-check verifies) and is named in ``unknown``. A rule then reads each call's rows through
its owners: rows of one example each, in any layout, are exact; a row of several examples, or of
none, sends the parameter to the fallback with the op that made it. Owners known from shapes
alone take the lanes' fast path (``lanes/``); the rest the owner algebra (``follow.py``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..constants import writes
from ..ops import ESCAPES, SCALAR_READS, SIZED_BY_VALUES, UNFOLLOWED, op_name
from ..tensors import tensors_in
from . import fixed, routes
from .arguments import filled
from .branches import IMPLYING, Branches
from .bytensor import ByTensor
from .follow import OwnerAlgebra
from .lanes import Lane, after
from .owners import MIXED, NONE, compact, is_batch, lane_of
from .readback import MADE, PICKS, given_back, noted, owned, picked, sized, valued
from .tags import Noted

if TYPE_CHECKING:
    from .finder import Finder

# an owner spec (``RowTrace.spec``): None for no example's, (dim, m) for the batch along one
# dimension, or IRREGULAR
Spec = tuple[int, int] | None
IRREGULAR = "irregular"


@functools.lru_cache(maxsize=1024)
def _lane_tensor(shape: tuple[int, ...], dim: int, m: int, batch: int, device) -> Tensor:
    """The owners (i // m) % B along ``dim``, one tensor for every pass of a model: owner
    tensors are never edited in place (the algebra copies before it writes)."""
    i = torch.arange(shape[dim], device=device)
    return (i // m % batch).view(shape)


class RowTrace(OwnerAlgebra, TorchFunctionMode):
    """Traces owners through one forward of a batch of ``batch`` examples."""

    def __init__(self, batch: int, tensors: tuple[Tensor, ...], device=None):
        super().__init__()
        self.batch = batch
        self.owners = ByTensor()
        self.selectors = ByTensor()  # owners of values that pick, where not ``owners``'s
        self.unknown: dict[str, None] = {}  # ops seen on batch tensors whose owners were assumed
        # the first op whose result's owners hold for this batch's values only (follow.py)
        self.picked_by: str | None = None
        self.created = ByTensor()  # tensors whose values the batch's shapes decide (fixed.py)
        self.finder: Finder | None = None  # the analysis's (finder.py): told what needs it
        self.own = 0  # above 0 while the tap's own code runs (its host reads are not the model's)
        self.read_back: list[tuple[Tensor, object]] = []  # (owners, value) of the model's reads
        self.noted = Noted()  # the plain numbers such reads gave: their owners, by value
        self.branches = Branches(batch)  # the booleans they gave, Python's branches
        self.routes: ByTensor | None = None  # ids the batch hit, slabs, rows (``routes.py``)
        self.mixed_by = ByTensor()  # tensor -> the op that mixed examples on its way
        self._lanes: dict[object, Tensor] = {}  # (rank, dim, size, m) -> its owners
        self._lane_of: dict[int, tuple[Tensor, Lane]] = {}  # id of those owners -> the lane
        first = next((t for t in tensors if isinstance(t, Tensor)), None)
        self.device = device or (first.device if first is not None else torch.device("cpu"))
        for t in tensors:
            if isinstance(t, Tensor) and t.dim() and t.shape[0] == batch:
                self.owners[t] = self.standard(t.dim())

    def standard(self, rank: int) -> Tensor:
        """(B, 1, ..., 1): row i of dimension 0 is example i's, the same tensor every time."""
        return self.lane_owners(rank, (0, 1), self.batch)

    def lane_owners(self, rank: int, lane: Lane, size: int) -> Tensor:
        """The owners of ``lane`` (``lanes/``) on a dimension of ``size``, the same tensor
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
        """The lane ``o`` is the owners of, if it is one of ``lane_owners``' tensors."""
        item = self._lane_of.get(id(o))
        return item[1] if item is not None and item[0] is o else None

    def spec(self, t: Tensor) -> Spec | str:
        """``t``'s owners as a spec: None where no example's, (dim, m) where the batch lies
        along a dimension (a lane's tensor, or owners of the same values), else IRREGULAR."""
        o = self.owners.get(t)
        if o is None:
            return None
        lane = self.lane(o)
        if lane is not None:
            return lane
        if bool((o == NONE).all()):
            return None
        lane = lane_of(o, self.batch)
        return IRREGULAR if lane is None else lane

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
        if name in ESCAPES:
            return self._host(name, func, args, kwargs)
        if name in UNFOLLOWED:
            return func(*args, **kwargs)
        if name == "__iter__" and args and args[0] in self.owners:
            rows = args[0].unbind(0)  # for row in x: the rows of unbind(0)
            self._record("unbind", torch.unbind, args[:1], {}, rows)
            return iter(rows)
        readers = picked(self, name, args) if name in PICKS else None
        out = func(*args, **kwargs)
        if name in MADE and (o := given_back(self, args, out)) is not None:
            self._set(out, o, f"{name} of values read on the host")
        self._record(name, func, args, kwargs, out)
        if name in IMPLYING and isinstance(out, Tensor) and out.numel() == 1 and args:
            x = args[0]  # a truth, or a number, of one element: each example's too? (branches.py)
            if isinstance(x, Tensor):
                hit = self.hits is not None and x in self.hits
                self.branches.after(self.owners.get(x), name, args, kwargs, out, hit)
        at = args[0] if name == "__setitem__" and args else out
        if readers and isinstance(at, Tensor):
            why = f"{name} by a value of the batch read on the host"
            self._set(at, owned(self.owner(at), readers), why)
        if (o := valued(self, name, args, kwargs, at)) is not None:
            self._set(at, o, f"{name} of a value of the batch read on the host")
        sized(self, name, args, kwargs)
        if self.routes is not None:
            routes.after(self, name, args, kwargs, out)
        return out

    def _record(self, name: str, func, args: tuple, kwargs: dict, out: object) -> None:
        """The owners of ``out``, the result of op ``name``; never an error in the user's forward:
        owners that cannot be followed are MIXED (the parameters they reach go to the fallback)."""
        tracked = self.owners.held(args, kwargs)  # (tensor, its owners)
        if not tracked:
            return
        fixed.after(self, name, args, kwargs, out)
        sized = name in SIZED_BY_VALUES or (name == "where" and len(args) == 1)
        if sized and not fixed.fixed(self, [t for t, _ in tracked]) or self._mask_sized(name, args):
            self._escaped(name)
        if self.finder is not None:
            self.finder.read(t for t, _ in tracked)
            if writes(name, kwargs):
                self.finder.wrote(kwargs.get("out", args[0] if args else None))
        origin = name
        try:
            if self._by_lanes(name, args, kwargs, tracked, out):
                return
            origin = next((self.mixed_by[t] for t, _ in tracked if t in self.mixed_by), name)
            self._follow(name, func, args, kwargs, out, origin)
        except Exception:  # owners could not follow this op: its results mix examples
            self._set(out, None, origin)

    def _host(self, name: str, func, args: tuple, kwargs: dict) -> object:
        """Values read on the host by ``name``: Python may branch on them. The finder sees each
        read of one scalar with its value (a light region's witness compares them), whatever
        tensors it read; any other read, of the batch's values, as an escape."""
        held = bool(self.owners.held(args, kwargs))
        out = func(*args, **kwargs)
        if name not in UNFOLLOWED:
            self._record(name, func, args, kwargs, out)
        if self.own:
            return out  # the tap's own
        shaped, own = fixed.fixed(self, tensors_in(args, kwargs)), None
        if isinstance(out, bool) and name in SCALAR_READS:  # a branch (``branches.py``)
            host = None if shaped or self.finder is None else len(self.finder.hosts)
            doubt = held and not shaped and self.batch > 1
            doubt = doubt and not self.branches.implied(args[0], out)
            own = self.branches.read(out, doubt, host, args[0])
        if shaped:
            return out  # values the batch's shapes decide (``fixed.py``)
        if held:  # values of the batch that Python may give back (``readback.py``)
            owners = self.selector(args[0]).expand(args[0].shape)
            self.read_back.append((owners, out))
            out = noted(self, name, args[0], owners, out)
        if name in SCALAR_READS and self.finder is not None:
            self.finder.host(name, out, held, own)
        elif held and name not in SCALAR_READS:
            self._escaped(name)
        return out

    def _escaped(self, name: str) -> None:
        """The batch's values read on the host by ``name``: Python may branch on them."""
        if self.finder is not None:
            self.finder.escaped(f"the batch's values read on the host ({name})")

    def picked(self, name: str) -> None:
        """Rows moved to places the batch's values pick, by ``name`` (follow.py)."""
        self.picked_by = self.picked_by or name
        if self.finder is not None:
            self.finder.picked(f"rows picked by the batch's values ({name})")

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
            self.owners[t] = self.lane_owners(t.dim(), lane, t.shape[dim])
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
