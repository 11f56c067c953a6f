"""Values of the batch read on the host and given back to torch: as a tensor, a list from
``lengths[perm].tolist()`` handed to ``pack_padded_sequence``, which makes it a tensor again;
as a Python integer that picks, ``W[int(x.sum(0).argmax())]``. The trace keeps each read's
owners and value; a tensor made from a sequence of the same values takes the owners of such a
read (where several match, the one that mixes least: the values, not where they came from,
decide the computation), and an element picked by such an integer, along a dimension every
example has alike, takes the owners of the values that gave it, as an index tensor's would
(``picked``): an integer of several examples' values makes it MIXED, and the batch is refused
or exact on the fallback. ``.item()`` and ``.tolist()`` integers carry their owners
(``Read``); ``int(t)``'s are plain, matched by value (a constant ``h[:, 0]`` that meets a
count of 0 the batch read costs the fallback, never a wrong number). Scalars made into
tensors are left alone (``torch.tensor(0.0)`` would meet any read of a zero), and so are
integers derived from a read (``k + 1``): the trace does not see Python."""

from __future__ import annotations

import torch
from torch import Tensor

from .arguments import filled
from .keys import starts
from .owners import MIXED, NONE, compact

# torch's functions that make a tensor of Python values
MADE = {"as_tensor", "tensor"}
# ops that pick elements by Python integers
PICKS = {"__getitem__", "__setitem__", "select", "narrow"}
# reads that hand their integers over as they are: tagged with their owners (``Read``)
TAGGED = {"item", "tolist"}
HIT = -3  # the owner of an id the batch hit, read (``routes.py``): every example's alike


class Read(int):
    """An integer that ``.item()`` or ``.tolist()`` read from the batch's values: its
    ``owner``, that of the value that gave it (an example, or MIXED)."""

    owner: int

    def __new__(cls, value: int, owner: int = MIXED) -> Read:  # a copy's: of no one known
        read = super().__new__(cls, value)
        read.owner = owner
        return read


def noted(trace: object, name: str, x: Tensor, value: object) -> object:
    """``value``, which host read ``name`` of ``x`` gave, its integers tagged with their owners
    where ``name`` hands them over as they are (``TAGGED``); else noted in ``read_ints`` by
    value (``int(t)``: Python makes a plain integer of what the read returns). Not booleans
    (a branch, not a pick), nor the ids a batch hit (a loop over every one is Mixtral's)."""
    if trace.hits is not None and x in trace.hits:  # ids: a loop over each is Mixtral's
        return _tagged(value, iter(lambda: HIT, None)) if name in TAGGED else value
    if trace.batch == 1:
        return value
    owners = iter(trace.owner(x).expand(x.shape).reshape(-1).tolist())
    if name in TAGGED:
        return _tagged(value, owners)
    for v, o in zip(_flat([value]), owners, strict=False):
        if o != NONE and not isinstance(v, bool) and (isinstance(v, int) or _whole(v)):
            trace.read_ints.setdefault(int(v), set()).add(o)
    return value


def _tagged(value: object, owners) -> object:
    if isinstance(value, list):
        return [_tagged(v, owners) for v in value]
    o = next(owners, NONE)
    plain = isinstance(value, int) and not isinstance(value, bool)
    return Read(value, o) if plain and o != NONE else value


def _whole(v: object) -> bool:
    return isinstance(v, float) and v.is_integer()


def _flat(values: list):
    for v in values:
        yield from _flat(v) if isinstance(v, list) else (v,)


def picked(trace: object, name: str, args: tuple, at: Tensor) -> Tensor | None:
    """The owners of ``at``, what op ``name`` of ``PICKS`` picked or wrote, where it picks
    along a dimension of ``args[0]`` that every example has alike (a parameter's, the
    features) by a Python integer of ``read_ints``: as an index tensor of the read's owners
    would (``selectors.py``), an element of no example's the one example's that read it, of
    another example's MIXED; else None. (Where several examples read the same value, an
    element of one of them keeps its owner: with its own value it computes the same.) Rows
    picked along the batch keep their owners (rows sorted by expert and cut at a count the
    batch read, as routed experts take theirs): which rows a cut keeps, the sort decided."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or not isinstance(at, Tensor):
        return None
    ints = trace.read_ints
    found = [(v, d) for v, d in _picks(name, args, x.dim()) if isinstance(v, Read) or v in ints]
    o, readers = compact(trace.owner(x)) if found else None, set()
    for value, dim in found:
        if not (o.dim() and o.shape[dim % o.dim()] > 1):
            readers |= {value.owner} if isinstance(value, Read) else ints[value]
    readers.discard(HIT)
    if not readers:
        return None
    mine = trace.owner(at)
    if MIXED in readers:
        return filled(at, MIXED)
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
