"""The tensors of one forward (or one region call) that no example owns: made from numbers and
the model's buffers alone (``Constants``), and which ops write a tensor in place (``writes``).
A tensor ``derived.py`` computes from parameters and these is read alike by every example."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .ops import WRITES_IN_PLACE

# functions whose result is made from numbers alone: shapes, ranges, fills (not ``torch.tensor``,
# whose numbers may have been read from the batch)
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye}
FACTORIES |= {torch.linspace, torch.logspace, torch.zeros_like, torch.ones_like}
FACTORIES |= {torch.full_like, torch.empty_like, Tensor.new_zeros, Tensor.new_ones}
FACTORIES |= {Tensor.new_full, Tensor.new_empty}


class Constants:
    """The tensors of one forward (or one region call) made from numbers and the model's
    buffers alone: a factory's result, or an op's on such tensors only. Every example reads
    the same value, by construction, so a tensor made from parameters and these is ``pure``:
    the analysis and a light region tell them the same way, without the trace. An in-place
    edit of one of them by anything else ends every one that shares its storage (a view of it,
    what it is a view of: RWKV's output written step by step leaves its ``max_state`` one), or
    all of them where that is a buffer's, whose views it does not hold."""

    def __init__(self, buffers: frozenset[int] = frozenset(), made: Sequence[Tensor] = ()):
        self.ids = set(buffers) | {id(t) for t in made}
        self.alive: list[Tensor] = list(made)  # held: no other tensor takes an id of theirs
        self.spoiled = False

    def __contains__(self, t: object) -> bool:
        return not self.spoiled and id(t) in self.ids

    def after(self, func, name: str, tensors: Sequence[Tensor], kwargs: dict, out) -> None:
        """Follow an op (``tensors``: its tensor arguments) whose result is ``out``."""
        made = func in FACTORIES or (tensors and all(id(t) in self.ids for t in tensors))
        if writes(name, kwargs):
            target = kwargs.get("out", tensors[0] if tensors else None)
            if not made and any(id(t) in self.ids for t in tensors):
                self._written(target)
            return
        if made:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor):
                    self.ids.add(id(t))
                    self.alive.append(t)

    def _written(self, t: object) -> None:
        """``t`` written in place by an op on more than constants: it, and every constant
        sharing its storage, are constants no more; where that storage may be a buffer's (``t``
        one, or a view of a tensor held as no made one), none is. Asked of the tensors with
        every function mode off: the trace beneath the tap would take it for the model's op."""
        alive = {id(a) for a in self.alive}
        with torch._C.DisableTorchFunction():
            base = t._base if isinstance(t, Tensor) and t._base is not None else t
            storage = storage_of(t)
            held = isinstance(t, Tensor) and not any(id(u) in self.ids - alive for u in (t, base))
            if storage is None or not held:
                self.spoiled = True
                return
            gone = {id(a) for a in self.alive if storage_of(a) in (storage, None)}
        self.ids -= gone | {id(t)}
        self.alive = [a for a in self.alive if id(a) not in gone]


def storage_of(t: object) -> int | None:
    """Where ``t``'s storage begins, or None where it has none to tell: not a tensor, or a
    tensor ``vmap`` batches (``torch.func`` inside a model, a computed read's VJP), whose
    storage torch does not give. Asked with function modes off."""
    if not isinstance(t, Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def writes(name: str, kwargs: dict) -> bool:
    """Whether op ``name`` writes a tensor: an in-place edit, or ``out=``."""
    inplace = (name.endswith("_") and not name.endswith("__")) or name in WRITES_IN_PLACE
    return inplace or "out" in kwargs
