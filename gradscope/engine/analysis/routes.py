"""Which rows a slab of an id the batch hit meets.

A loop over every id the batch's routing hit (``hits.py``) serves each id's slab of a parameter
(Mixtral's ``W[e]``) as every example's, which holds where the slab meets only the rows routed
to that id: each example's rows then meet its own ids' slabs, and an id no row of an example
routes to gives it nothing (``hidden[top_x] @ W[e]``, ``top_x`` where ``mask[e]`` holds; Ergo's
``x[ids == e] @ W[e]``). Which ids the loop visits is the batch's, through Python: a slab that
meets rows not routed to it (``sum(h * W[e] for e in hits)``) gives each example what the other
examples' ids decided. So the trace marks (``RowTrace.routes``):

- ID: the ids (``nonzero``'s positions of a mask of the batch, ``unique``'s ids, moved), and
  ``.tolist()``'s integers of them (``tags.HIT``);
- SLAB: what an id picks from a tensor of no example's (a parameter, a tensor made from one),
  and what is computed from slabs and values of no example's alone;
- ROUTED: rows an id's comparison made (``ids == e``), the mask an id picks (``mask[e]``), its
  positions (``where``), the rows they pick, and what is computed from routed rows, slabs and
  values of no example's.

A slab that meets other rows of the batch makes them MIXED: the batch is refused as mixing, or
exact on the fallback where alone each example agrees. Routed rows that meet other rows are
not routed (``h + mask[e]`` is not ``h``'s rows routed to e); only a pick by a routed index or
mask routes rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import INDICES
from ..tensors import tensors_in
from .owners import NONE
from .tags import HIT, Read

ID, SLAB, ROUTED = "id", "slab", "routed"
CROSSED = "crossed"  # not a mark: a slab met rows not routed to its id
# comparisons: rows of each example's own values against an id say which rows route to it
COMPARES = {"eq", "ne", "lt", "gt", "le", "ge", "__eq__", "__ne__", "__lt__", "__gt__"}
COMPARES |= {"__le__", "__ge__", "isin"}
# picks of ``args[0]``'s elements by its other arguments
TAKES = {"__getitem__", "index_select", "gather", "take_along_dim", "take", "masked_select"}


def after(trace: object, name: str, args: tuple, kwargs: dict, out: object) -> None:
    """Marks ``out`` of op ``name`` in ``trace.routes``; MIXED where a slab meets rows of the
    batch not routed to its id."""
    routes = trace.routes
    marks = {mark for _, mark in routes.held(args, kwargs)}  # (most ops: none, at one pass)
    if _hit_int(args, kwargs):
        marks.add(ID)
    if not marks:
        return
    ins = tensors_in(args, kwargs)
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, Tensor)]
    if name in TAKES and args and isinstance(args[0], Tensor):
        by = {routes.get(t) for t in tensors_in(args[1:], kwargs)} - {None}
        by |= {ID} if _hit_int(args[1:], kwargs) else set()
        kind = _taken(trace, args[0], routes.get(args[0]), by)
    elif name in INDICES and len(args) == 1:
        kind = ROUTED if marks & {ROUTED} else None  # positions of a routed mask
    else:
        kind = _computed(trace, name, ins, marks)
    if kind == CROSSED:
        trace._set(out, None, f"{name}: a slab of an id the batch hit, on rows not routed to it")
        return
    for t in outs:
        if kind is not None:
            routes[t] = kind


def _taken(trace: object, x: Tensor, own: str | None, by: set[str]) -> str | None:
    """What a pick of ``x`` (marked ``own``) by indices marked ``by`` gives."""
    if ID in by:
        if _of_no_example(trace, x):
            return SLAB  # W[e], of a parameter or a tensor made from one
        return ROUTED if not (x.is_floating_point() or x.is_complex()) else None  # mask[e]
    if ROUTED in by:
        return ROUTED  # rows picked where a routed mask holds
    return own


def _computed(trace: object, name: str, ins: list[Tensor], marks: set[str]) -> str | None:
    """What an op of tensors ``ins`` (marked ``marks``, besides the rows of no mark) gives."""
    routes = trace.routes
    rows = [t for t in ins if routes.get(t) is None and not _of_no_example(trace, t)]
    if SLAB in marks and rows:
        return CROSSED
    if rows:
        return ROUTED if ID in marks and name in COMPARES and ROUTED not in marks else None
    if ROUTED in marks:
        return ROUTED
    return SLAB if SLAB in marks else ID


def _of_no_example(trace: object, t: Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or bool((trace.owner(t) == NONE).all())


def _hit_int(args: tuple, kwargs: dict) -> bool:
    """Whether an integer among the arguments (an index key's included) is a hit id read."""
    for a in (*args, *kwargs.values()):
        for v in a if isinstance(a, (tuple, list)) else (a,):
            if isinstance(v, Read) and v.owner == HIT:
                return True
    return False
