"""Rows picked and written by a boolean mask over dimension 0 (``rowops.py``), as Ergo's experts
pick theirs (``x[top_k_index == e]``, then ``out[mask] = y``): a 1-D mask of x's length, alone
in the key or before whole slices. A mask made from an example's values says which of that
row's values go on, so its rows meet x's (and y's) where it picks or writes: one example's, or
no example's, a flag where the values say otherwise (``RowFlow.combine``). The positions it
picks are found on the device at the size the op's result gives, so no host sync is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .rowflow import RowFlow

NO_ONE = -1  # a row of no example


def mask_of(x: object, key: object, leading: bool = False) -> Tensor | None:
    """The boolean mask of ``x[key]`` over x's rows: a 1-D mask of x's length first (where
    ``leading``, a mask of x's leading dimensions: a padded batch's ``ids[keep]``), every other
    index a whole slice or an ellipsis; None for any other key."""
    key = key if isinstance(key, tuple) else (key,)
    mask = key[0] if key else None
    if not isinstance(x, Tensor) or not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        return None
    k = mask.dim() if leading else 1
    rest = all(k is Ellipsis or (isinstance(k, slice) and k == slice(None)) for k in key[1:])
    rest = rest and len(key) - 1 + k <= x.dim() + (Ellipsis in key[1:])
    return mask if rest and mask.dim() == k and mask.shape == x.shape[:k] else None


def picked(flow: RowFlow, x: Tensor, mask: Tensor, out: object) -> object:
    """``x[mask]``'s rows: x's at the positions the mask keeps, met by the mask's there (a
    mask of several dimensions keeps elements of rows: each the row it lies in)."""
    rows, own = flow.of(x), flow.of(mask)
    if rows is None or own is None or not isinstance(out, Tensor) or not out.dim():
        return NotImplemented
    found = [r for r in (rows, own) if r is not False]
    if not found:
        return False
    inner = mask[0].numel() if mask.dim() > 1 else 1  # elements of a row the mask spans
    return flow.combine(found)[_positions(mask.reshape(-1), out.shape[0]) // inner]


def written(flow: RowFlow, x: Tensor, mask: Tensor, y: object) -> object:
    """``x[mask] = y``'s rows: y's (or none) at the positions the mask keeps, x's elsewhere,
    each met by the mask's; y's rows must be one per position written, or one for them all."""
    rows, own, given = flow.of(x), flow.of(mask), flow.of(y)
    if rows is None or own is None or given is None:
        return NotImplemented
    if rows is False and own is False and given is False:
        return False
    n = x.shape[0]
    none = torch.full((n,), NO_ONE, dtype=torch.long, device=x.device)  # (n,)
    if given is False:
        put = none
    elif y.dim() != x.dim():
        return NotImplemented  # y's dimension 0 is not the rows written
    elif y.shape[0] == 1:  # one row of y for every position written
        put = torch.where(mask, given, NO_ONE)
    else:
        put = none.index_copy(0, _positions(mask, y.shape[0]), given)  # (n,)
    mine = own if own is not False else none
    kept = torch.where(mask, NO_ONE, rows) if rows is not False else none
    return torch.where(mask, flow.combine([put, mine]), flow.combine([kept, mine]))


def _positions(mask: Tensor, count: int) -> Tensor:
    """(count,) the positions where a 1-D mask holds, ``count`` of them as the op found."""
    return torch.nonzero_static(mask, size=count).squeeze(1)
