"""Each example's own value of a branch the batch read on its values (``analysis/branches.py``),
where a replayed batch's witness reads it: the tensor its ``all()``, ``any()`` or ``fast_all``
reduced, kept as the op ran, and reduced again by example with the analysed owners, so that no
example runs alone to read it (``analysis/ways.py`` compares them)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..analysis.branches import own

# the ops an ``all()``, ``any()`` or ``x.sum() == x.numel()`` runs
REDUCING = frozenset(
    {torch.all, Tensor.all, torch.any, Tensor.any, torch.sum, Tensor.sum}
    | {torch.eq, Tensor.eq, Tensor.__eq__}
)


class Owned:
    """The examples' own values of a witness's reads of the batch's values: ``hosts`` its
    analysed reads (op, value, ``Own``), each one's put in ``values`` as it is read (None where
    the tensor it reduced was not seen)."""

    def __init__(self, hosts: Sequence[tuple] | None, batch: int, values: list | None):
        # none kept where the replay checks no branch (its examples all run whole, or none)
        self.owns = tuple(h[2] for h in hosts or ()) if values is not None else ()
        some = any(o is not None for o in self.owns)
        self.reducing = REDUCING if some else frozenset()  # the ops to keep the tensor of
        self.batch, self.values = batch, values
        self._last: tuple[Tensor, Tensor] | None = None  # (a reduction's result, what it reduced)

    def reduce(self, func, args: tuple, kwargs: dict) -> object:
        """Runs a reduction, keeping what it reduced: ``x.sum() == n`` keeps the sum's."""
        out = func(*args, **kwargs)
        x = args[0] if args else None
        if isinstance(out, Tensor) and out.numel() == 1 and isinstance(x, Tensor):
            last = self._last
            if last is not None and last[0] is x:  # the count's comparison
                self._last = (out, last[1])
            elif len(args) == 1 and not kwargs:
                self._last = (out, x)
        return out

    def read(self, k: int, x: object) -> None:
        """The witness's read ``k`` of ``x``, its examples' own values where analysed so."""
        how = self.owns[k] if k < len(self.owns) else None
        if how is None:
            return
        last = self._last
        seen = last is not None and last[0] is x
        self.values.append(own(last[1], how[0], how[1], self.batch) if seen else None)
