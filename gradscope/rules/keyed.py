"""Each row's expert from a grouped product's offsets, and how many rows each key of a keyed
routed read (``routed.Routed.keyed``) holds, read on the host once for every read that keys the
same rows the same way: a routed layer's experts (HF Mixtral's gate-up and down) are two grouped
products of one offsets tensor on rows of the same examples, whose keys are then the same: one
host read for both, where each read took its own (W9: 4 a pass, not 8)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

# offsets -> the rows' examples (a weak reference), and the counts by what else they were of
_READ = WeakIdKeyDictionary()


def experts_of(offs: Tensor, rows: int) -> Tensor:
    """(rows,) the group of ``offs`` (cumulative row ends) each row falls in; ``len(offs)`` for
    a row past the last."""
    at = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, at, right=True)


def key_counts(by: Tensor, keys: int, offs: Tensor | None, own: Tensor, form: tuple) -> list[int]:
    """(keys,) how many rows ``by`` (each row's key, ``keys`` for none) puts in each key, on the
    host: those read before for the same ``offs`` and examples ``own`` (the same tensors,
    neither written since) keyed the same ``form`` (experts, batch, rows, which rows are apart),
    else read now. Without offsets (a read of rows a value picked, or merged) always read."""
    if offs is None or offs.is_inference() or own.is_inference():
        return _read(by, keys)
    held = _READ.get(offs)
    if held is None or held[0]() is not own:
        held = _READ[offs] = (weakref.ref(own), {})
    of = (own._version, offs._version, keys, form)
    if of not in held[1]:
        held[1][of] = _read(by, keys)
    return held[1][of]


def _read(by: Tensor, keys: int) -> list[int]:
    return torch.bincount(by, minlength=keys)[:keys].tolist()
