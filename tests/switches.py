"""Switches a test model changes between batches, kept out of the state witness's sight
(``gradscope/engine/state.py``): in a mapping that is neither a dict nor an object of
attributes, which the state compares. A test whose model
switches its structure by them reaches the witnesses behind the state's (the calls, the reads,
the operations, the rows); ``engine/test_state.py`` tests the state's own."""

from __future__ import annotations

from torch import nn


class _Switches(dict):
    __slots__ = ()  # no attributes of its own: the state looks into neither it nor its items


class Switched(nn.Module):
    """A module whose attributes named in ``switches`` live in a mapping of their own."""

    switches: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.switches:
            self.__dict__.setdefault("_switched", _Switches())[name] = value
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> object:
        switched = self.__dict__.get("_switched", {})
        return switched[name] if name in switched else super().__getattr__(name)
