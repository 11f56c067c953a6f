"""Whether an op moves elements to places the batch's values pick (``OwnerAlgebra._follow``
asks first): rows picked by computed indices, masks, sorts, scatters; the scatters whose
owners no value of their index changes; and the masks whose picks the host sizes."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import PICKED, PLACES, SCATTERS, SORTS
from ..tensors import tensors_in
from .arguments import picked_dims
from .owners import NONE


class Picks:
    """Part of ``OwnerAlgebra``: uses its ``owner``, ``_of_batch`` and ``_varies``."""

    def _picked(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether op ``name`` moves elements, along dimensions where its source's owners vary,
        to places that values computed from the batch pick (rows picked by computed indices,
        masks, sorts): its result's owners hold for this batch's values only."""
        x = args[0] if args else None
        if not isinstance(x, Tensor):
            return False
        if name in SORTS:  # values move along the dimension sorted
            dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else -1)
            return self._varies(x, [dim])
        if name not in PICKED and name not in PLACES and name not in SCATTERS:
            return False
        # the places a write picks are its key's; the values it writes there pick none
        keyed = name in ("__setitem__", "index_put", "index_put_")
        where = (args[1:2], {}) if keyed else (args[1:], kwargs)
        pickers = [t for t in tensors_in(*where) if self._of_batch(t)]
        if name in SCATTERS and pickers and self._scatter_holds(name, args, kwargs):
            return False  # a top-k mask: where it writes, nothing's owners change
        if name in SCATTERS and self._in_rows(name, args, kwargs):
            return False  # each row's values back into its own row
        if name in PLACES or name in SCATTERS or name == "__setitem__" or not pickers:
            return bool(pickers)  # writes where values say: whatever the owners
        if name == "__getitem__":
            return self._varies(x, picked_dims(args[1], pickers, x.dim()))
        if name in ("take", "masked_select") or (
            name == "repeat_interleave" and "dim" not in kwargs and len(args) < 3
        ):
            return self._varies(x, range(x.dim()))  # flattened
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        dim = args[2] if name in ("take_along_dim", "repeat_interleave") and len(args) > 2 else dim
        return self._varies(x, range(x.dim()) if dim is None else [dim])

    def _mask_sized(self, name: str, args: tuple) -> bool:
        """Whether ``x[mask]`` picks by a boolean mask of the batch's values, whether or not
        the owners vary (a batch of one): its result's size is read on the host, as
        ``nonzero``'s is."""
        key = args[1] if name == "__getitem__" and len(args) > 1 else None
        keys = key if isinstance(key, tuple) else (key,)
        return any(
            isinstance(k, Tensor) and k.dtype == torch.bool and self._of_batch(k) for k in keys
        )

    def _scatter_holds(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether ``x.scatter(dim, index, src)`` gives owners that no value of ``index``
        changes: ``src`` a number or no example's, and ``x`` no example's too, or kept where
        written (an add, a reduce including itself) and its owners constant along ``dim`` (a
        mask of -inf with zeros where each row's top k are: DeepSeek's sparse attention)."""
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        src = kwargs.get("src", kwargs.get("value", args[3] if len(args) > 3 else None))
        if not isinstance(dim, int) or self._varies(args[0], [dim]):
            return False
        if isinstance(src, Tensor) and not bool((self.owner(src) == NONE).all()):
            return False
        keep = name.startswith("scatter_add") or (
            name.startswith("scatter_reduce") and kwargs.get("include_self", True)
        )
        return keep or bool((self.owner(args[0]) == NONE).all())

    def _in_rows(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether ``x.scatter(dim, index, src)`` writes each row of ``src`` into the same row
        of ``x``, whole rows (Llama 4's router scores: -inf but at each token's top k): ``x``
        no example's, ``src``'s owners constant along ``dim``. Each row of the result is then
        its source row's example's (``_scatter``), whatever the index: its values pick places
        within the row, which carry no gradient."""
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
        src = kwargs.get("src", args[3] if len(args) > 3 else None)
        if name not in ("scatter", "scatter_") or not isinstance(dim, int):
            return False
        x = args[0]
        if not isinstance(src, Tensor) or not isinstance(index, Tensor) or src.shape != index.shape:
            return False
        if index.dim() != x.dim():
            return False
        d = dim % x.dim()
        pairs = enumerate(zip(index.shape, x.shape, strict=True))
        if any(n != m for k, (n, m) in pairs if k != d) or self._varies(src, [d]):
            return False
        return bool((self.owner(x) == NONE).all())
