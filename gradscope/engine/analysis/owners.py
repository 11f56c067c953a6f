"""Owner tensors: which example each element of a tensor computed from the batch belongs to.

An owner tensor is an int64 tensor of the same rank as the tensor it describes, broadcastable to
its shape (size 1 along the dimensions every element of which has the same owner): each element
holds an example's index, ``NONE`` for an element that depends on no example (a constant, a
parameter, a row written with a constant) or ``MIXED`` for one that depends on several. This
module holds the algebra; ``analysis/trace.py`` applies it op by op as the forward runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..rows import Gather, Lanes, Layout

NONE, MIXED = -1, -2
_BIG = 1 << 62  # above every example index: "no example seen yet" inside the reductions


def batch_owner(batch: int, dim: int, device: torch.device) -> Tensor:
    """(B, 1, ..., 1) of rank ``dim``: row i of a batch tensor belongs to example i."""
    return torch.arange(batch, device=device).view(batch, *([1] * (dim - 1)))


def is_batch(o: Tensor, batch: int) -> bool:
    """Whether ``o`` says row i is example i's, along dimension 0 and nowhere else."""
    if o.dim() == 0 or o.shape[0] != batch or any(n != 1 for n in o.shape[1:]):
        return False
    return bool((o.reshape(-1) == torch.arange(batch, device=o.device)).all())


def rows_or_none(o: Tensor, batch: int) -> bool:
    """Whether each element of ``o`` along a batch dimension 0 is its row's example's or from no
    example (the start token a decoder puts before each example's tokens)."""
    if o.dim() == 0 or o.shape[0] not in (1, batch):
        return False
    rows = batch_owner(batch, o.dim(), o.device)
    return bool(((o == rows) | (o == NONE)).all())


def compact(o: Tensor) -> Tensor:
    """The same owners with every zero-stride dimension narrowed to size 1 (free: a view)."""
    for d in range(o.dim()):
        if o.stride(d) == 0 and o.shape[d] > 1:
            o = o.narrow(d, 0, 1)
    return o


def shrink(o: Tensor) -> Tensor:
    """``compact``, and trailing dimensions along which a materialised tensor is constant (an
    empty one as it is: no element to compare, transformers 5.25's Mamba splits one off)."""
    o = compact(o)
    for d in range(o.dim() - 1, 0, -1) if o.numel() else ():
        if o.shape[d] == 1:
            continue
        if not bool((o == o.narrow(d, 0, 1)).all()):
            break
        o = o.narrow(d, 0, 1)
    return o


def combine(*owners: Tensor) -> Tensor:
    """Elementwise: the owner of a value computed from values of these owners (broadcast)."""
    out = owners[0]
    for o in owners[1:]:
        a, b = torch.broadcast_tensors(out, o)
        out = torch.where(a == NONE, b, torch.where((b == NONE) | (a == b), a, MIXED))
    return compact(out)


def reduce(o: Tensor, dims: Sequence[int], keepdim: bool = True) -> Tensor:
    """The owner of values computed from all elements along ``dims``."""
    dims = [d % o.dim() for d in dims] if o.dim() else []
    varying = [d for d in dims if o.shape[d] > 1]
    if varying:
        hi = o.amax(varying, keepdim=True)
        lo = torch.where(o == NONE, _BIG, o).amin(varying, keepdim=True)
        o = torch.where(lo == _BIG, NONE, torch.where(lo == hi, hi, MIXED))
    if not keepdim:
        for d in sorted(dims, reverse=True):
            o = o.squeeze(d) if o.shape[d] == 1 else o.select(d, 0)
    return o


def segment_combine(base: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """(m,) ``base`` with ``values[j]`` combined into ``base[index[j]]`` (index_add's owners)."""
    hi = base.clone().scatter_reduce_(0, index, values, "amax")
    low = torch.where(values == NONE, _BIG, values)
    lo = torch.where(base == NONE, _BIG, base).scatter_reduce_(0, index, low, "amin")
    return torch.where(lo == _BIG, NONE, torch.where(lo == hi, hi, MIXED))


def scatter_combine(base: Tensor, dim: int, index: Tensor, values: Tensor, keep: bool) -> Tensor:
    """The owners of ``base.scatter_add(dim, index, values)`` (``keep``: the targets keep their
    own values, as in an add; else they are overwritten, as in ``scatter``), all full-shaped."""
    if not keep:
        return base.scatter(dim, index, values)
    hi = base.scatter_reduce(dim, index, values, "amax")
    low = torch.where(values == NONE, _BIG, values)
    lo = torch.where(base == NONE, _BIG, base).scatter_reduce(dim, index, low, "amin")
    return torch.where(lo == _BIG, NONE, torch.where(lo == hi, hi, MIXED))


def slots(owner: Tensor, shape: Sequence[int], source: Sequence[int]) -> Tensor:
    """(prod(shape),): for each position of ``shape`` (row-major), owned by ``owner`` (broadcast
    to it), its slot in a (B * prod(source),) tensor of per-example values of an operand of
    shape ``source`` broadcast to ``shape``: owner * prod(source) + the operand's position it
    reads. Negative where no one example owns it."""
    n = math.prod(source)
    at = torch.arange(n, device=owner.device).view((1,) * (len(shape) - len(source)) + (*source,))
    return (owner.expand(shape) * n + at.expand(shape)).reshape(-1)


def reshaped(o: Tensor, shape: Sequence[int], new: Sequence[int]) -> Tensor | None:
    """The owners of ``t.reshape(new)`` for ``t`` of ``shape`` with owners ``o``, expanding ``o``
    only within the groups of dimensions that the reshape merges or splits and along which the
    owners vary (a (B, T) merge costs B*T, never the features). None if the shapes do not match."""
    shape, new = list(shape), list(new)
    if -1 in new:
        known = torch.Size([d for d in new if d != -1]).numel()
        new[new.index(-1)] = torch.Size(shape).numel() // max(known, 1)
    found = groups(shape, new)
    if found is None:
        return None
    full, target = list(o.shape), []
    for i0, i1, j0, j1 in found:
        if any(o.shape[d] > 1 for d in range(i0, i1)):
            full[i0:i1] = shape[i0:i1]
            target += new[j0:j1]
        else:
            target += [1] * (j1 - j0)
    return compact(o.expand(full).reshape(target))


def groups(shape: Sequence[int], new: Sequence[int]) -> list[tuple[int, int, int, int]] | None:
    """The smallest groups of dimensions ``shape[i0:i1]`` that a reshape to ``new`` turns into
    ``new[j0:j1]`` (equal sizes), as (i0, i1, j0, j1); None if the sizes do not match."""
    if math.prod(shape) != math.prod(new):
        return None
    found, i, j = [], 0, 0
    while i < len(shape) or j < len(new):
        i0, j0, a, b = i, j, 1, 1
        if i < len(shape):
            a, i = shape[i], i + 1
        if j < len(new):
            b, j = new[j], j + 1
        while a != b:
            if a < b and i < len(shape):
                a, i = a * shape[i], i + 1
            elif j < len(new):
                b, j = b * new[j], j + 1
            else:
                return None
        found.append((i0, i, j0, j))
    return found


def padded_rows(o: Tensor, batch: int) -> bool:
    """Whether owners ``o`` give row i along dimension 0 to example i or to none, element by
    element (a padded sequence's: ``pad_packed_sequence``'s zeros past each length)."""
    if not o.dim() or o.shape[0] != batch:
        return False
    rows = torch.arange(batch, device=o.device).view(-1, *(1,) * (o.dim() - 1))  # (B, 1, ...)
    return bool(((o == rows) | (o == NONE)).all())


def lane_of(o: Tensor, batch: int) -> tuple[int, int] | None:
    """(dim, m) where owners ``o`` read (i // m) % B along dimension ``dim`` (of a size that B*m
    divides) and vary along no other, whether or not ``o`` is the trace's canonical tensor for
    that lane (reads values: the analysis asks)."""
    o = shrink(o)  # (B, T) owners constant along T: (B, 1)
    if batch == 1:  # every element the one example's, however many rows: any lane is (0, 1)
        return (0, 1) if o.dim() and o.numel() and bool((o == 0).all()) else None
    dims = [d for d in range(o.dim()) if o.shape[d] > 1]
    if not dims:
        return None
    if len(dims) != 1 or o.shape[dims[0]] % batch:
        return None
    flat = o.reshape(-1)
    i = torch.arange(flat.shape[0], device=o.device)
    if flat.shape[0] == batch:  # row r is example r (sequence-first): the common case
        return (dims[0], 1) if torch.equal(flat, i) else None
    m = int(torch.argmax((flat != flat[0]).to(torch.uint8)))  # where example 0 ends
    if m == 0 or flat.shape[0] % (batch * m) or not torch.equal(flat, i // m % batch):
        return None
    return dims[0], m


def rows_of(owner: Tensor, batch: int) -> Layout:
    """The layout of rows owned by ``owner`` (*rows,), every entry an example's index: ``Lanes``
    where the owners read (i // m) % B along one dimension and vary along no other (reads
    values: the analysis asks, once), else ``Gather``."""
    lane = lane_of(owner, batch) if owner.dim() else None
    if lane is not None:
        return Lanes(lane[0], lane[1], owner.dim())
    return Gather.of(owner, batch)
