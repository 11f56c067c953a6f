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
    """Every call of a synchronising tensor method or torch function, by name."""
    calls: list[str] = []
    saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in METHODS]
    saved += [(torch, name, getattr(torch, name)) for name in FUNCTIONS]

    def counting(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return call

    try:
        for owner, name, original in saved:
            setattr(owner, name, counting(name, original))
        yield calls
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
