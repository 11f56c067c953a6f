"""The analysis's rows policy, one for module calls (``session.py``) and functional reads
(``functions.py``, ``tap.py``): which rows a call or read takes as the examples'.

- rows ``shared`` by the batch (a position table looked up once, ``position_ids`` of shape
  (1, T), ``wpe(arange(T))``) are expanded to the batch, so that each example has its own output
  rows and a rule can serve the call, while the engine's check shows that every loss is as it was;
- B rows computed, wholly or in part, from no example (a buffer of zeros expanded to the batch,
  ``token_type_ids``, a decoder's start token before each example's tokens) are ``assumable``:
  taken to have row i read by example i alone, while the losses' owners show that this held;
- a call or read on tensors that are ``batch_free`` (T5's relative-position table looked up by
  buckets of ``arange``) is followed by the tap as computed from parameters alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from .owners import NONE, rows_or_none
from .trace import RowTrace

ASSUMED = object()  # rows taken as the examples' until the losses' owners say otherwise


def shared(trace: RowTrace, x: object) -> bool:
    """Whether ``x`` is one set of rows for the whole batch: a (1, ...) tensor or 1-D indices,
    computed from no example (its owners, read last: the shapes rule out most tensors)."""
    if not isinstance(x, Tensor) or x.dim() == 0:
        return False
    # 1-D: indices (a position table looked up); else one row
    shaped = not (x.is_floating_point() or x.is_complex()) if x.dim() == 1 else x.shape[0] == 1
    return shaped and bool((trace.owner(x) == NONE).all())


def batch_free(trace: RowTrace, tensors: Iterable[Tensor]) -> bool:
    """Whether none of ``tensors`` holds anything of an example (an empty one may be the rows
    routed to an expert: it is no example's on this batch only)."""
    for t in tensors:
        o = trace.owners.get(t)
        if t.numel() == 0 or (
            o is not None and (trace.is_standard(o) or not bool((o == NONE).all()))
        ):
            return False
    return True


def assumable(trace: RowTrace, x: Tensor, owners: Tensor) -> bool:
    """Whether B rows ``x`` with ``owners`` (reduced over its features) hold rows of their
    example or of none, some of none: taken as the examples' while the losses confirm it."""
    batch = trace.batch
    if x.dim() == 0 or x.shape[0] != batch or trace.is_standard(owners):
        return False
    return bool((owners == NONE).any()) and rows_or_none(owners, batch)
