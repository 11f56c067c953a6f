"""Counting host-device synchronisations: calls of the tensor methods and torch functions that
wait for the device (``bool``, ``item``, ``tolist``, ``equal``, ``unique``, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# each waits for the device: to read a value, or to size its output by the values
# (``unique``: GPU runs showed the embedding rule's, one a table and batch)
METHODS = (
    "__bool__", "item", "tolist", "__int__", "__float__", "__index__", "numpy", "nonzero",
    "unique", "unique_consecutive", "masked_select",
)  # fmt: skip
FUNCTIONS = ("equal", "nonzero", "allclose", "unique", "unique_consecutive", "masked_select")


@contextlib.contextmanager
def counted() -> Iterator[list[str]]:
    """Every call of a synchronising tensor method or torch function, by name: once where a
    function mode (the engine's) is handed the replaced method and calls it again."""
    calls: list[str] = []
    inside = [False]  # a read a function mode handed back to the method it came through: once
    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in METHODS]
    saved += [(torch, name, getattr(torch, name)) for name in FUNCTIONS]

    def counting(name, original):
        def call(*args, **kwargs):
            if inside[0]:
                return original(*args, **kwargs)
            calls.append(name)
            inside[0] = True
            try:
                return original(*args, **kwargs)
            finally:
                inside[0] = False

        return call

    try:
        for owner, name, original in saved:
            setattr(owner, name, counting(name, original))
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
