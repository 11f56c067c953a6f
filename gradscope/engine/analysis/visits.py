"""A module call of an analysed forward, as the regions' finder (``finder.py``) records it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(eq=False)
class Visit:
    """One call of a module in the analysed forward."""

    module: nn.Module
    index: int  # the order calls began in
    parent: Visit | None
    first: int  # the session's events before it began: its inner calls start there
    at_entry: int  # autograd's counter when it began
    arg_ids: frozenset[int]
    entry: tuple | str  # owner specs of its tensor arguments, or IRREGULAR
    steps: int = 0  # calls of hooked modules inside it
    at_exit: int = 0
    exit: tuple | str = ()  # owner specs of its tensor outputs, or IRREGULAR
    foreign: bool = False  # read something followed from before it began, not an argument
    constant: tuple[bool, ...] = ()  # which tensor arguments were made from constants alone
    why: str | None = None  # what inside it needs analysis, if anything
    shapes: tuple = ()  # (shape, dtype) of its tensor arguments
    out_shapes: tuple = ()  # ... and outputs
    out_ids: frozenset[int] = frozenset()  # its tensor outputs, by id
    done: bool = False  # ended
    # something it made, or wrote in place, was read after its end other than as its output
    leaks: bool = False


def above(v: Visit) -> Iterable[Visit]:
    """The calls under way around ``v``, innermost first."""
    u = v.parent
    while u is not None:
        yield u
        u = u.parent
