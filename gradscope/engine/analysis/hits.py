"""Which moves of the ids a batch hit keep every one of them (``selectors.py``).

``nonzero``'s positions of a routing mask, and ``unique``'s ids, list along dimension 0 the ids
the whole batch hit. A loop over every one (``for e in hits``: ``unbind``) routes every row to
its own id, so an id it gives picks a slab every example shares (Mixtral's ``W[e]``), and so
does a move that keeps dimension 0 whole (a view, a column, ``squeeze(-1)``, ``flip``). A move
that takes some positions along it (``hits[0]``, a slice, ``narrow``, ``split``) picks the ids
that the other examples' values put first: values the batch mixed, not a slab every example
shares. So is any move this module does not know to keep them whole (a transpose, a ``cat``):
refused or exact on the fallback, never taken as every hit.
"""

from __future__ import annotations

from torch import Tensor

from ..ops import RESHAPES
from .keys import starts, takes

WHOLE, ONE = "whole", "one"  # dimension 0 lists every hit; one hit, every other taken too

# moves along a dimension (the position of its argument, its default): some of the hits, on 0
ALONG = {"select": (1, None), "narrow": (1, None), "index_select": (1, None)}
ALONG |= {"split": (2, 0), "chunk": (2, 0), "tensor_split": (2, 0), "split_with_sizes": (2, 0)}
# moves that keep dimension 0's length with every hit in it (reordered, repeated alongside)
SAME_ROWS = {"flip", "roll", "expand", "expand_as", "repeat"} | RESHAPES


def moved(name: str, args: tuple, kwargs: dict, x: Tensor, out: Tensor) -> str | None:
    """The hits ``out``, a result of move or reshape ``name`` of ``x``, whose dimension 0
    lists every hit: WHOLE where ``out``'s does too, ONE for each of ``unbind``'s along it,
    None where it takes some of them, or moves them where this does not follow."""
    n = x.dim()
    if name == "unbind":
        return ONE if _dim(args, kwargs, 1, 0) % n == 0 else WHOLE
    if name in ALONG:
        dim = _dim(args, kwargs, *ALONG[name])
        return WHOLE if isinstance(dim, int) and dim % n != 0 else None
    if name == "__getitem__":
        return _keyed(args[1] if len(args) > 1 else (), n)
    if name == "unsqueeze":
        return WHOLE if _dim(args, kwargs, 1, 0) % out.dim() != 0 else None
    if name == "squeeze" and x.shape[0] == 1:
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        dims = range(n) if dims is None else dims if isinstance(dims, (tuple, list)) else (dims,)
        return None if any(d % n == 0 for d in dims) else WHOLE
    if name in SAME_ROWS or name == "squeeze":
        return WHOLE if out.dim() >= 1 and out.shape[0] == x.shape[0] else None
    return None


def _dim(args: tuple, kwargs: dict, at: int, default: int | None) -> int | None:
    """An op's ``dim`` argument: by keyword, at position ``at``, else ``default``."""
    dim = kwargs.get("dim", args[at] if len(args) > at else default)
    return dim if isinstance(dim, int) else default


def _keyed(key: object, n: int) -> str | None:
    """WHOLE where index ``key`` takes dimension 0 of a tensor of ``n`` dimensions whole (a
    full slice, an ellipsis, no entry), None where it picks in it or puts a dimension first."""
    key = key if isinstance(key, tuple) else (key,)
    rest = n - sum(takes(k) for k in key)
    for _, k, at in starts(key, n):
        if at > 0:
            break
        if k is None or isinstance(k, bool):
            return None  # a new dimension before the hits'
        if k is Ellipsis:
            if rest > 0:
                return WHOLE
            continue
        return WHOLE if isinstance(k, slice) and k == slice(None) else None
    return WHOLE
