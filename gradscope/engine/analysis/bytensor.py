"""A map from tensors to values by identity, for the trace's many intermediates."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import Tensor


class ByTensor:
    """tensor -> value, by identity, keeping no tensor alive (a pass's many intermediates)."""

    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, object]] = {}
        self.on_set: Callable[[Tensor], None] | None = None  # told of each tensor set

    def get(self, t: object, default: object = None) -> object:
        item = self._items.get(id(t))
        return item[1] if item is not None and item[0]() is t else default

    def __contains__(self, t: object) -> bool:  # once per op and argument: one lookup, no call
        item = self._items.get(id(t))
        return item is not None and item[0]() is t

    def found_in(self, values: tuple | list) -> list[tuple[int, object]]:
        """(position, value) of each of ``values`` held: once per op, so no call per value."""
        items, hits = self._items, []
        for k, t in enumerate(values):
            item = items.get(id(t))
            if item is not None and item[0]() is t:
                hits.append((k, item[1]))
        return hits

    def held(self, args: tuple, kwargs: dict) -> list[tuple[Tensor, object]]:
        """(tensor, value) of each tensor held among an op's arguments and in its list
        arguments: once per op, the lookups and the values in one pass."""
        items, hits = self._items, []
        for a in (*args, *kwargs.values()) if kwargs else args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                item = items.get(id(t))
                if item is not None and item[0]() is t:
                    hits.append((t, item[1]))
        return hits

    def __getitem__(self, t: object) -> object:
        return self.get(t)

    def __setitem__(self, t: Tensor, value: object) -> None:
        self._items[id(t)] = (weakref.ref(t), value)
        if self.on_set is not None:
            self.on_set(t)
