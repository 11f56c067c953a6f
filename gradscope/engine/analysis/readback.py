"""Values of the batch read on the host and given back to torch: as a tensor, a list from
``lengths[perm].tolist()`` handed to ``pack_padded_sequence``, which makes it a tensor again;
as a Python number that picks, ``W[int(x.sum(0).argmax())]``, scales, ``h * x.max().item()``,
or fills, ``torch.full_like(h, k)``. The trace keeps each read's owners and value; a tensor
made from a sequence of the same values takes the owners of such a read (where several match,
the one that mixes least: the values, not where they came from, decide the computation).

``.item()`` and ``.tolist()`` hand over numbers tagged with their owners, which Python's
arithmetic keeps (``tags.py``); ``int(t)``'s and ``float(t)``'s are plain, noted by value
(``Noted``: a constant ``h[:, 0]`` that meets a count of 0 the batch read costs the fallback,
never a wrong number). Such a number, along a dimension every example has alike, picks as an
index tensor of its owners would (``picked``); as an operand of an elementwise op, or the
value a factory fills or makes a tensor of (``valued``), it is one more operand of its owners.
A number of several examples' values makes what it touches MIXED, and the batch is refused or
exact on the fallback; one example's, used for another's rows, likewise. As a size or a count
(``h.new_zeros(B, T, k)``: ``sized``) no owner follows it, and each batch's every example is
checked alone (``tags.Noted.lost``), as where Python orders one (``if k > 3:``); a boolean
read is a branch (``branches.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import ELEMENTWISE, ELEMENTWISE_IN_PLACE
from .arguments import filled
from .keys import starts
from .owners import MIXED, NONE, compact
from .tags import HIT, Read, ReadFloat, joined, owner_of, tagged

# torch's functions that make a tensor of Python values
MADE = {"as_tensor", "tensor"}
# ops that pick elements by Python integers
PICKS = {"__getitem__", "__setitem__", "select", "narrow"}
# reads that hand their numbers over as they are: tagged with their owners (``tags.py``)
TAGGED = {"item", "tolist"}
ARRAYS = {"numpy", "__array__"}  # reads that hand over an array: its numbers plain
# factories and fills: where the values they make a tensor of sit, (position, keyword)
VALUES = {
    **dict.fromkeys(("tensor", "as_tensor"), (0, "data")),
    "new_tensor": (1, "data"),
    "scalar_tensor": (0, "s"),
    **dict.fromkeys(("full", "full_like", "fill_", "fill"), (1, "fill_value")),
    "new_full": (2, "fill_value"),
    "__setitem__": (2, "value"),
    **dict.fromkeys(("index_fill", "index_fill_"), (3, "value")),
}
# ranges: each element from the start, end and step (a count picks as ``h[..., :k]`` does)
RANGES = {"arange", "linspace", "logspace"}
SPLITS = {"split", "split_with_sizes", "tensor_split"}  # cuts at sizes (``sized``)


def noted(trace: object, name: str, x: Tensor, owners: Tensor, value: object) -> object:
    """``value``, which host read ``name`` of ``x`` (its values' ``owners``, expanded) gave,
    its numbers tagged with their owners where ``name`` hands them over as they are
    (``TAGGED``); else noted in ``trace.noted`` by value (``int(t)``: Python makes a plain
    number of what the read returns). Not the ids a batch hit (a loop over every one is
    Mixtral's), nor a boolean ``item()`` reads (a branch: ``branches.py``); booleans
    ``tolist()`` hands over (a list each example alone reads less of) count as lost."""
    if trace.hits is not None and x in trace.hits:  # ids: a loop over each is Mixtral's
        return _tagged(value, iter(lambda: HIT, None), None) if name in TAGGED else value
    if trace.batch == 1:
        return value
    each = iter(owners.reshape(-1).tolist())
    if name in TAGGED:
        if name == "tolist" and any(isinstance(v, bool) for v in _flat([value])):
            trace.noted.lost = True
        out = _tagged(value, each, trace.noted)
        if isinstance(out, Read):  # a maximum or a minimum: bounds each example's own
            out.bound = trace.branches.bound(x)
        return out
    for v, o in zip(_flat([value]), each, strict=False):
        trace.noted.add(v, o)
    if name in ARRAYS and bool((owners != NONE).any()):
        trace.noted.lost = True  # an array Python may compute anything from
    return value


def _tagged(value: object, owners, noted) -> object:
    if isinstance(value, list):
        return [_tagged(v, owners, noted) for v in value]
    return tagged(value, next(owners, NONE), noted)


def _flat(values: list):
    for v in values:
        yield from _flat(v) if isinstance(v, (list, tuple)) else (v,)


def picked(trace: object, name: str, args: tuple) -> set[int]:
    """The readers of the Python integers read from the batch by which op ``name`` of
    ``PICKS`` picks or writes along a dimension of ``args[0]`` that every example has alike (a
    parameter's, the features), asked before the op's owners are followed (a write makes the
    owners of ``args[0]`` vary where it wrote). What it picked or wrote takes them as an index
    tensor of the read's owners would (``selectors.py``, ``owned``). Rows picked along the
    batch keep their owners (rows sorted by expert and cut at a count the batch read, as
    routed experts take theirs): which rows a cut keeps, the sort decided."""
    x, ints = args[0] if args else None, trace.noted.ints
    if not (trace.noted.handed or ints) or not isinstance(x, Tensor):
        return set()  # no such number yet (a number another batch's trace tagged is a constant)
    found = [(v, d) for v, d in _picks(name, args, x.dim()) if isinstance(v, Read) or v in ints]
    return _readers([v for v, dim in found if not _varies(trace, x, dim)], ints)


def valued(trace: object, name: str, args: tuple, kwargs: dict, at: Tensor) -> Tensor | None:
    """The owners of ``at``, what op ``name`` made or wrote, where a number read from the
    batch is one of its values: an elementwise op's operand (``h * k``, ``h.clamp(max=k)``),
    what a factory or a fill writes (``VALUES``, ``RANGES``); else None."""
    if not (trace.noted.handed or trace.noted.floats) or not isinstance(at, Tensor):
        return None  # no such number yet: the trace's every op asks
    if name in VALUES:
        pos, key = VALUES[name]
        values = args[pos] if len(args) > pos else kwargs.get(key)
        if isinstance(values, (list, tuple)) and name not in ("__setitem__", "index_fill"):
            return _elements(trace, values, at)
        values = (values,)
    elif name in RANGES:
        values = (*args, *(kwargs.get(k) for k in ("start", "end", "step", "steps")))
    elif _elementwise(name):
        values = (*args, *kwargs.values())
    else:
        return None
    return owned(trace.owner(at), _readers(values, trace.noted.floats))


def sized(trace: object, name: str, args: tuple, kwargs: dict) -> None:
    """Where a number read from the batch is a size or a count of op ``name``
    (``h.new_zeros(B, T, k)``, ``expand``, ``repeat``, ``pad``, ``topk``'s k), the shapes of the
    batch's tensors are its values, which no owner follows: each batch's every example is
    checked alone (``Noted.lost``). Not a pick (``picked``), a value (``valued``), nor a split
    along a dimension whose owners vary (rows sorted by expert, split at counts read: each row
    keeps its own, as a cut's)."""
    if not trace.noted.handed or name in PICKS or name in RANGES or _elementwise(name):
        return
    pos, key = VALUES.get(name, (None, None))  # the values it writes: ``valued``'s
    given = (a for i, a in enumerate(args) if i != pos)
    for a in (*given, *(v for k, v in kwargs.items() if k != key)):
        for v in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(v, (Read, ReadFloat)) and v.owner not in (NONE, HIT):
                if not (name in SPLITS and _along_rows(trace, args, kwargs)):
                    trace.noted.lost = True
                return


def _along_rows(trace: object, args: tuple, kwargs: dict) -> bool:
    """Whether a split cuts ``args[0]`` along a dimension its owners vary along."""
    x, dim = args[0] if args else None, args[2] if len(args) > 2 else kwargs.get("dim", 0)
    return isinstance(x, Tensor) and isinstance(dim, int) and _varies(trace, x, dim)


def _varies(trace: object, x: Tensor, dim: int) -> bool:
    """Whether the owners of ``x`` vary along ``dim`` (rows of several examples)."""
    o = compact(trace.owner(x))
    return o.dim() > 0 and o.shape[dim % o.dim()] > 1


def _elementwise(name: str) -> bool:
    in_place = name.endswith("_") and not name.startswith("__") and name[:-1] in ELEMENTWISE
    return name in ELEMENTWISE or name in ELEMENTWISE_IN_PLACE or in_place


def _readers(values, by_value: dict) -> set[int]:
    """The owners of the numbers among ``values`` read from the batch: the tagged ones'
    joined (their values are those examples'), and for each plain one ``by_value`` holds
    every example that read it (with its own value, each computes the same)."""
    tags, readers = NONE, set()
    for v in values:
        if isinstance(v, (Read, ReadFloat)):
            tags = joined(tags, v.owner)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v in by_value:
            readers |= by_value[v]
    return readers | {tags} - {NONE, HIT}


def _elements(trace: object, values: list | tuple, at: Tensor) -> Tensor | None:
    """The owners of a tensor made of ``values``, element by element (``torch.tensor(l)``)."""
    flat = list(_flat(list(values)))
    if len(flat) != at.numel() or not any(isinstance(v, (Read, ReadFloat)) for v in flat):
        return None
    return torch.tensor([owner_of(v) for v in flat], device=at.device).reshape(at.shape)


def owned(mine: Tensor, readers: set[int]) -> Tensor | None:
    """Owners ``mine``, of elements a number of ``readers``' picked or computed: an element of
    no example's the reader's, another example's MIXED (where several examples read the same
    value, an element of one of them keeps its owner: with its own value it computes the
    same); None where no reader."""
    if not readers:
        return None
    if MIXED in readers:
        return filled(mine, MIXED)
    if len(readers) == 1:
        (one,) = readers
        return torch.where((mine == NONE) | (mine == one), one, MIXED)
    return torch.where(torch.isin(mine, mine.new_tensor(sorted(readers))), mine, MIXED)


def _picks(name: str, args: tuple, n: int):
    """(integer, the dimension it picks along) of op ``name``'s Python integers."""
    if name in ("select", "narrow"):
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else None
        for v in args[2:4] if dim is not None else ():
            if isinstance(v, int) and not isinstance(v, bool):
                yield v, dim
        return
    key = args[1] if len(args) > 1 else ()
    key = key if isinstance(key, tuple) else (key,)
    for _, k, dim in starts(key, n):
        for v in (k.start, k.stop, k.step) if isinstance(k, slice) else (k,):
            if isinstance(v, int) and not isinstance(v, bool) and dim < n:
                yield v, dim


def given_back(trace: object, args: tuple, out: object) -> Tensor | None:
    """The owners of ``out``, made by a function of ``MADE`` from ``args[0]``, where it is a
    sequence of values some read of ``trace.read_back`` (each (owners, value)) gave; else None.
    A region that gives values of the batch back is analysed on every batch: its replay follows
    rows through tensors, not through Python."""
    reads, made = trace.read_back, args[0] if args else None
    if not reads or not isinstance(made, (list, tuple)) or not isinstance(out, Tensor):
        return None
    values = out.detach().reshape(-1).double()
    found = []
    for owners, value in reads:
        v = torch.as_tensor(value).reshape(-1)
        if v.numel() == values.numel() and torch.equal(v.to(values), values):
            found.append(owners.reshape(out.shape))
    if not found:
        return None
    if trace.finder is not None:
        trace.finder.need("the batch's values read on the host, given back as a tensor")
    return min(found, key=lambda o: bool((o == MIXED).any()))
