"""Owners known from shapes alone: the batch along one dimension, the trace's fast path.

A lane ``(dim, m)`` says that along dimension ``dim`` (of size n*B*m) element i belongs to
example (i // m) % B, and that the owners do not vary along any other dimension. Row i of a
batch tensor is (0, 1); a sequence-first (T, B, E) is (1, 1); heads folded into the batch,
(B*H, T, d), is (0, H); tokens flattened position-major, (T*B, E), is (0, 1) over T*B rows.
``after`` gives the lane of an op's result from its tracked inputs' lanes, with no tensor op,
for the ops that keep one: views and reshapes, elementwise ops, and linear, matmul, attention,
norms and reductions that leave the lane's dimension alone. None leaves the op to the owner
algebra (``owners.py``), which is exact for every op it knows. The rules, by op: ``moves.py``
(views and reshapes), ``computed.py`` (products, norms, losses, reductions).
"""

from __future__ import annotations

from torch import Tensor

from ...ops import ELEMENTWISE
from ..arguments import binary
from .base import Lane, broadcast
from .computed import COMPUTED
from .moves import LANE_MOVES, reshape_lane

__all__ = ["Lane", "after", "reshape_lane"]

# how each op moves lanes, by its name: the moves and the ops computed along them
_BY_OP = {**LANE_MOVES, **COMPUTED}


def after(name: str, args: tuple, kwargs: dict, lanes: dict[int, Lane], out: Tensor, batch: int):
    """The lane of ``out``, the (first) result of op ``name``, whose tracked inputs (by id) have
    ``lanes``; or None where the op may move examples across the lane or mix them."""
    if name in ELEMENTWISE or binary(name, args, kwargs):
        if name == "where" and len(args) == 1:
            return None  # positions of true elements, not values
        return broadcast(args, kwargs, lanes, out)
    follow = _BY_OP.get(name)
    if follow is None or not args or not isinstance(args[0], (Tensor, list, tuple)):
        return None
    return follow(args, kwargs, lanes, out, batch)
