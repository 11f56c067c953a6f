"""A 2-D weight read row by row at each row's own expert inside a routed region
(``routed.py``): Ergo's per-expert norm scale, ``weight[expert_ids]``, one id per route, on rows
the batch's values pick. The tap serves it as ``F.embedding(ids, weight)`` (its recipe's op);
here it runs so too, and its gradient goes to ``rules/routed.py`` as a routed read whose input is
a 1 on every row: example b's gradient of row e is the sum of the output gradients of b's rows
whose id is e, and its norm the sum over pairs of such rows of their gradients' products, on
the device, no host sync. Ids out of range fail in ``F.embedding`` as in the analysed batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...rules.routed import Routed


def by_id(w: Tensor, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether op ``name`` is ``w[ids]`` of a 2-D ``w`` by a 1-D tensor of integer ids."""
    ids = args[1] if len(args) == 2 else None
    return (
        name == "__getitem__"
        and not kwargs
        and w.dim() == 2
        and isinstance(ids, Tensor)
        and ids.dim() == 1
        and not (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
    )


class ByIdReads:
    """Uses the routed region's ``owned``, ``batch``, ``_recipe``, ``_other`` and ``_serve``."""

    def _by_id(self, args: tuple) -> Tensor:
        """``w[ids]``: row ``ids[s]`` of ``w`` on row s, each row's own expert's."""
        w, ids = args
        p = self.owned.get(id(w))
        out = F.embedding(ids, w)  # (n, H), as the tap ran it
        kind = ("embedding", (("weight", p.name if p else ""),), False, False)
        if p is None or self._recipe(kind, ids) is None:
            return self._other("__getitem__", out)

        def routed(a: Tensor, grad: Tensor, rows: Tensor) -> dict:
            ones = grad.new_ones(a.shape[0], 1)  # (n, 1): each row's input to its id's row
            return {p.name: Routed(ones, grad, rows, a, w.shape, self.batch, True)}

        return self._serve((p,), ids, w, out, routed)
