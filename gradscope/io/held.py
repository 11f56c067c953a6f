"""Objects a Python caller holds (a model, a DataLoader, a dict of tensors), named in a config
by a spec of their own so that a run reads them where it would read a file: ``data.path``,
``--ref`` and ``model.factory`` may be ``<DataLoader at 0x7f...>`` while the API's call runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_HELD: dict[str, Any] = {}


def is_held(spec: object) -> bool:
    """Whether ``spec`` names an object held for the running call."""
    return isinstance(spec, str) and spec in _HELD


def held(spec: str) -> Any:
    return _HELD[spec]


@contextlib.contextmanager
def holding(obj: Any) -> Iterator[str]:
    """``obj``'s spec, which names it for as long as the block runs."""
    spec = f"<{type(obj).__name__} at {id(obj):#x}>"
    mine = spec not in _HELD
    _HELD[spec] = obj
    try:
        yield spec
    finally:
        if mine:
            del _HELD[spec]
