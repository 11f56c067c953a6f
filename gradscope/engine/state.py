"""The model's own state that a forward may branch on: each module's attributes of plain values
(``training``, flags, modes, counters). A program was analysed at one state; at another,
a forward may make other ops at the same calls, shapes and autograd node counts (a mean over
the batch instead of over the features), which the witness would not see. So a program replays
only at the state its batch began with; at another the batch is analysed (``replayed.py``)."""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

import torch
from torch import nn

# values a branch may read, compared by value (a tensor, a list or an object of the user's is
# not: comparing it costs or syncs, and what a forward reads of it is out of sight)
PLAIN = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device})

Values = tuple[tuple[tuple[str, object], ...], ...]


def _plain(v: object) -> bool:
    return type(v) in PLAIN or isinstance(v, enum.Enum)


def values_of(modules: Sequence[nn.Module]) -> Values:
    """Each module's attributes of plain values (or enums), in the modules' order."""
    return tuple(tuple((k, v) for k, v in vars(m).items() if _plain(v)) for m in modules)


class State:
    """The state of ``modules`` now, kept to tell whether they are in it again: quickly, by
    each module's attribute count and its plain attributes' values (one C call a module), and
    else attribute by attribute."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules, self.values = tuple(modules), values_of(modules)
        self._quick = [
            (vars(m), len(vars(m)), _getter([k for k, _ in kv]))
            for m, kv in zip(self.modules, self.values, strict=True)
        ]
        self._got = [get(d) for d, _, get in self._quick]

    def differs(self) -> str | None:
        """None where the modules are in this state again; else the first attribute that
        differs, as ``Class.name``."""
        try:
            if all(
                len(d) == n and get(d) == got
                for (d, n, get), got in zip(self._quick, self._got, strict=True)
            ):
                return None
        except Exception:  # noqa: BLE001 - an attribute gone, or one no plain value compares to
            pass
        now = values_of(self.modules)
        for m, was, is_ in zip(self.modules, self.values, now, strict=True):
            if was != is_:
                old, new = dict(was), dict(is_)
                return next(
                    f"{type(m).__name__}.{k}"
                    for k in {**old, **new}
                    if k not in old or k not in new or old[k] != new[k]
                )
        return None


def _getter(keys: list[str]):
    """The values of ``keys`` in a module's ``__dict__``, by one C call."""
    return operator.itemgetter(*keys) if keys else lambda d: None
