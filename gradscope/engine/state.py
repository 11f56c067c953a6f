"""The model's own state that a forward may branch on or index by: each module's attributes of
plain values (``training``, flags, modes, counters) and the tensors it keeps (buffers, tensor
attributes), as they are and by their version (what autograd counts writes in place by). A
program was analysed at one state; at another, a forward may make other ops at the same calls,
shapes and autograd node counts (a mean over the batch instead of over the features, rows
gathered by a permutation the model keeps), which the witness would not see. So a program
replays only at the state its batch began with; at another the batch is analysed
(``replayed.py``)."""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

import torch
from torch import Tensor, nn

# values a branch may read, compared by value (a tensor, a list or an object of the user's is
# not: comparing it costs or syncs, and what a forward reads of it is out of sight)
PLAIN = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device})

Values = tuple[tuple[tuple[str, object], ...], ...]


def _plain(v: object) -> bool:
    return type(v) in PLAIN or isinstance(v, enum.Enum)


def values_of(modules: Sequence[nn.Module]) -> Values:
    """Each module's attributes of plain values (or enums), in the modules' order."""
    return tuple(tuple((k, v) for k, v in vars(m).items() if _plain(v)) for m in modules)


def _version(t: Tensor) -> int:
    """The count of ``t``'s writes in place (an inference tensor keeps none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class State:
    """The state of ``modules`` now, kept to tell whether they are in it again: each tensor
    they keep, itself and its version; then quickly, by each module's counts of attributes and
    buffers and its plain attributes' values (one C call a module), or else attribute by
    attribute."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules, self.values = tuple(modules), values_of(modules)
        self.tensors = [
            (m, where, k, t, _version(t))
            for m in self.modules
            for where in (m._buffers, vars(m))
            for k, t in where.items()
            if isinstance(t, Tensor)
        ]
        self._quick = []  # each module's dicts, their lengths, its plain values' getter and them
        for m, kv in zip(self.modules, self.values, strict=True):
            get = _getter([k for k, _ in kv])
            self._quick.append(
                (vars(m), m._buffers, len(vars(m)), len(m._buffers), get, get(vars(m)))
            )

    def differs(self) -> str | None:
        """None where the modules are in this state again; else the first attribute that
        differs, as ``Class.name``."""
        for m, where, k, t, version in self.tensors:
            if where.get(k) is not t or _version(t) != version:
                return f"{type(m).__name__}.{k}"
        try:
            if all(
                len(d) == n and len(b) == nb and get(d) == got
                for d, b, n, nb, get, got in self._quick
            ):
                return None
        except Exception:  # noqa: BLE001 - an attribute gone, or one no plain value compares to
            pass
        return self._named()

    def _named(self) -> str | None:
        """The first attribute that differs, looked for attribute by attribute: a tensor the
        state did not keep, or a plain value."""
        kept = {(id(m), k) for m, _, k, _, _ in self.tensors}
        now = values_of(self.modules)
        for m, was, is_ in zip(self.modules, self.values, now, strict=True):
            new_tensors = [
                k
                for where in (m._buffers, vars(m))
                for k, t in where.items()
                if isinstance(t, Tensor) and (id(m), k) not in kept
            ]
            if new_tensors:
                return f"{type(m).__name__}.{new_tensors[0]}"
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
