"""Rows through a packed sequence's ops and an ``embedding_bag`` cut by offsets, followed by a
routed region (``rowops.py``): ``_pack_padded_sequence`` lays slot j's rows (the input's row j,
met by its length's) at that slot's place in every step it lasts; a recurrent op on packed data
(``_VF.lstm(data, batch_sizes, hx, ...)``) and ``_pad_packed_sequence`` keep each slot's rows,
which must be one example's (or none's: a flag where the values say otherwise, none needed for
the rows a pack laid out); a bag of ``embedding_bag`` is its positions' rows, met. A packed
kernel's initial states meet their slots' rows; its final states are left unfollowed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...rules.embedding_bag import BAG_ARGS, bag_of
from ...rules.recurrent import slots
from ..ops import RECURRENT
from .masked import NO_ONE
from .moved import Along

if TYPE_CHECKING:
    from .rowflow import RowFlow


def packed_after(flow: RowFlow, name: str, args: tuple, kwargs: dict, out: object) -> object:
    """The rows of ``out`` after op ``name`` (of ``ops.SLOTTED``), or NotImplemented."""
    if name == "_pack_padded_sequence":
        return _pack(flow, out, *args, *kwargs.values())
    if name == "_pad_packed_sequence":
        return _pad(flow, *args, *kwargs.values())
    if name == "embedding_bag":
        return _bags(flow, args, kwargs, out)
    return _recurrent(flow, args, out) if name in RECURRENT else NotImplemented


def _pack(flow: RowFlow, out: object, x: Tensor, lengths: Tensor, batch_first: bool, *_) -> object:
    """``_pack_padded_sequence(input, lengths, batch_first)``: (data's rows, batch sizes none's).
    A (B, T, ...) input's rows along dimension 0 (``batch_first``), a (T, B, ...) one's along 1."""
    at, length = flow.at(x), flow.of(lengths)
    if at is None or length is None or not isinstance(out, tuple):
        return NotImplemented
    if at is not False and at[1] != (0 if batch_first else 1):
        return NotImplemented
    found = [r.to(x.device) for r in (at[0] if at else False, length) if r is not False]
    if not found:
        return False, False
    per = flow.combine(found)  # (B,) each slot's example: its row's, met by its length's
    return _laid(flow, per, out[1]), False


def _laid(flow: RowFlow, per: Tensor, sizes: Tensor) -> Tensor:
    """(N,) the rows of packed data whose slot j is example ``per[j]``'s, kept as laid out."""
    rows = per[slots(sizes, per.device)]
    flow.slotted[id(rows)] = (rows, sizes, per)
    return rows


def _met(flow: RowFlow, rows: Tensor, group: Tensor, count: int) -> Tensor:
    """(count,) each group's example: its rows' (``group`` (N,) each row's), met, a flag where
    two examples meet in one; no example's rows meet any."""
    base = torch.full((count,), NO_ONE, dtype=rows.dtype, device=rows.device)
    per = base.scatter_reduce(0, group, rows, "amax")
    flow.flag(torch.where(rows == NO_ONE, per[group], rows) != per[group])
    return per


def _per_slot(flow: RowFlow, rows: Tensor, sizes: Tensor) -> tuple[Tensor, Tensor]:
    """Each slot's rows, as the data's rows (N,), and each slot's example (B,): as the pack laid
    them out, or met here."""
    held = flow.slotted.get(id(rows))
    if held is not None and held[0] is rows and held[1] is sizes:
        return rows, held[2]
    per = _met(flow, rows, slots(sizes, rows.device), int(sizes[0]) if len(sizes) else 0)
    return _laid(flow, per, sizes), per


def _recurrent(flow: RowFlow, args: tuple, out: object) -> object:
    """A recurrent op on packed data: the output's rows its slot's, met by the slot's initial
    states' (along dimension 1, in slot order: the RNN sorted them); final states unfollowed."""
    data, sizes = args[0], args[1] if len(args) > 1 else None
    packed = isinstance(sizes, Tensor) and sizes.dim() == 1 and not sizes.is_floating_point()
    if not packed or not isinstance(out, tuple) or len(args) < 3:
        return NotImplemented
    states = args[2] if isinstance(args[2], (tuple, list)) else (args[2],)
    rows, at = flow.of(data), [flow.at(h) for h in states]
    if rows is None or any(a is None or (a is not False and a[1] != 1) for a in at):
        return NotImplemented
    found = [a[0] for a in at if a is not False]
    if rows is False and not found:
        return (False, *(None for _ in out[1:]))
    if rows is False:
        return NotImplemented  # a state's rows through data of no example's: not followed
    rows, per = _per_slot(flow, rows, sizes)
    if found:
        rows = _laid(flow, flow.combine([per, *found]), sizes)
    return (rows, *(None for _ in out[1:]))


def _pad(flow: RowFlow, data: Tensor, sizes: Tensor, batch_first: bool, *_) -> object:
    """``_pad_packed_sequence(data, batch_sizes, batch_first, value, length)``: each slot's rows
    (its padding the slot's too, as the analysis takes a padded row), the lengths none's."""
    rows = flow.of(data)
    if rows is None:
        return NotImplemented
    if rows is False:
        return False, False
    per = _per_slot(flow, rows, sizes)[1]
    return (per if batch_first else Along(per, 1)), False


def _bags(flow: RowFlow, args: tuple, kwargs: dict, out: object) -> object:
    """``F.embedding_bag`` of a 1-D input cut by offsets: each bag's rows its positions' (and
    their weights'), met."""
    bound = {**dict(zip(BAG_ARGS, args, strict=False)), **kwargs}
    ids, offsets = bound.get("input"), bound.get("offsets")
    if not isinstance(ids, Tensor) or ids.dim() != 1 or not isinstance(offsets, Tensor):
        return NotImplemented
    if flow.of(bound.get("weight")) is not False:
        return NotImplemented
    found = [flow.of(t) for t in (ids, bound.get("per_sample_weights")) if t is not None]
    if any(r is None for r in found):
        return NotImplemented
    found = [r for r in found if r is not False]
    if not found or not isinstance(out, Tensor):
        return False if not found else NotImplemented
    bag, starts = bag_of(offsets, ids.shape[0], bool(bound.get("include_last_offset")))
    return _met(flow, flow.combine(found), bag, starts.shape[0])
