"""Values of the batch read on the host and given back to torch: as a tensor, a list from
``lengths[perm].tolist()`` handed to ``pack_padded_sequence``, which makes it a tensor again;
as a Python integer that picks, ``W[int(x.sum(0).argmax())]``. The trace keeps each read's
owners and value; a tensor made from a sequence of the same values takes the owners of such a
read (where several match, the one that mixes least: the values, not where they came from,
decide the computation), and an element picked, along a dimension every example has alike,
by an integer that a read of several examples' values gave, wherever it came from, is MIXED:
the examples are refused as mixing, or exact on the fallback where alone they agree (a
constant ``h[:, 0]`` that meets a count of 0 the batch read costs the fallback, never a wrong
number). Scalars made into tensors are left alone
(``torch.tensor(0.0)`` would meet any read of a zero), and so are integers derived from a read
(``k + 1``) and one example's value read and used for all: the trace does not see Python."""

from __future__ import annotations

import torch
from torch import Tensor

from .keys import starts
from .owners import MIXED, compact

# torch's functions that make a tensor of Python values
MADE = {"as_tensor", "tensor"}
# ops that pick elements by Python integers
PICKS = {"__getitem__", "__setitem__", "select", "narrow"}


def noted(trace: object, x: Tensor, value: object) -> None:
    """Notes in ``trace.read_ints`` the integers of ``value``, which a host read of ``x`` gave,
    that several examples' values made (not booleans: a branch, not a pick; not the ids a
    batch hit, a loop over every one of which is Mixtral's: ``hits.py``)."""
    if trace.batch == 1 or (trace.hits is not None and x in trace.hits):
        return
    mixed = (trace.owner(x).expand(x.shape) == MIXED).reshape(-1).tolist()
    for v, m in zip(_flat(value if isinstance(value, list) else [value]), mixed, strict=False):
        if m and not isinstance(v, bool) and (isinstance(v, int) or _whole(v)):
            trace.read_ints.add(int(v))


def _whole(v: object) -> bool:
    return isinstance(v, float) and v.is_integer()


def _flat(values: list):
    for v in values:
        yield from _flat(v) if isinstance(v, list) else (v,)


def picked(trace: object, name: str, args: tuple) -> bool:
    """Whether op ``name`` of ``PICKS`` picks, along a dimension of ``args[0]`` that every
    example has alike (a parameter's, the features), by a Python integer of ``read_ints``.
    Rows picked along the batch keep their owners (rows sorted by expert and cut at a count
    the batch read, as routed experts take theirs), which the trace follows as it does any
    slice: which rows a cut keeps, the sort decided, not the count."""
    x = args[0] if args else None
    if not isinstance(x, Tensor):
        return False
    o = compact(trace.owner(x))
    for value, dim in _picks(name, args, x.dim()):
        if value in trace.read_ints and not (o.dim() and o.shape[dim % o.dim()] > 1):
            return True
    return False


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
