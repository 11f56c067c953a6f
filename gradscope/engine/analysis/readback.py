"""Values of the batch read on the host and given back to torch as a tensor: a list from
``lengths[perm].tolist()`` handed to ``pack_padded_sequence``, which makes it a tensor again.
The trace keeps each read's owners and value; a tensor made from a sequence of the same values
takes the owners of such a read (where several match, the one that mixes least: the values,
not where they came from, decide the computation). Scalars made into tensors are left alone
(``torch.tensor(0.0)`` would meet any read of a zero)."""

from __future__ import annotations

import torch
from torch import Tensor

from .owners import MIXED

# torch's functions that make a tensor of Python values
MADE = {"as_tensor", "tensor"}


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
