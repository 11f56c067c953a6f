"""The tensors of an analysed forward whose values its batch's shapes alone decide: made by a
creation op (``zeros_like(ids)``, ``arange(T)``), or by ops on such tensors, the model's buffers
and tensors made from numbers only (the tap's ``Constants``). Longformer's global mask
(``zeros_like(ids)``, its first column set to 1) and all it makes of it (``mask == 2``, the
positions its ``nonzero`` finds, the count its ``item`` reads) are the same on every batch of a
signature, with the model in the same state, which the replay's witness proves: rows that such
a tensor picks are placed by the batch's shapes, not its values, and its values read on the host
are the same on every batch. The trace keeps them in ``RowTrace.created``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..constants import storage_of, writes
from ..ops import CREATIONS
from ..tensors import tensors_in

if TYPE_CHECKING:
    from .trace import RowTrace


def after(trace: RowTrace, name: str, args: tuple, kwargs: dict, out: object) -> None:
    """Follow op ``name``, one on a tensor the trace follows, whose result is ``out``: its
    outputs are fixed where it creates them or every argument is; a write in place by
    anything else ends the fixed tensors sharing the written one's storage (its views too)."""
    created = trace.created
    constants = trace.finder.constants if trace.finder is not None else None
    fixed = name in CREATIONS or all(
        created.get(t) if t in trace.owners else (constants is not None and t in constants)
        for t in tensors_in(args, kwargs)
    )
    if writes(name, kwargs):
        target = kwargs.get("out", args[0] if args else None)
        if not fixed and isinstance(target, Tensor):
            _unfix(trace, target)
        return
    if fixed:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                created[t] = True


def fixed(trace: RowTrace, tensors: list[Tensor]) -> bool:
    """Whether every one of ``tensors`` (at least one) is followed and fixed."""
    return bool(tensors) and all(t in trace.owners and trace.created.get(t) for t in tensors)


def _unfix(trace: RowTrace, target: Tensor) -> None:
    """``target`` written by values not fixed: it and every fixed tensor sharing its storage
    are fixed no more (asked with every function mode off: no op of the model's)."""
    created = trace.created
    with torch._C.DisableTorchFunction():
        if not (created.get(target) or created.get(target._base)):
            return  # neither fixed nor a view of one: no fixed tensor shares its storage
        storage = storage_of(target)  # None: no storage to tell, so none is kept fixed
        for ref, value in list(created._items.values()):
            t = ref()
            if value and t is not None and (storage is None or storage_of(t) in (storage, None)):
                created[t] = False
