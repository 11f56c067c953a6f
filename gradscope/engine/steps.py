"""The replay program (``replay/session.py``): what a later batch of an analysed signature
repeats, as the analysis wrote it (``analysis/program.py``): each hooked call outside the traced
regions and each region call, in the order they began, with the autograd nodes made between
them."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .backward.backward import Requests
from .recipes import Recipe
from .rows import Layout
from .state import State


class Diverged(Exception):
    """The batch is not one the program describes: it is analysed in full."""


@dataclass(frozen=True)
class Step:
    """One call of a hooked module outside the regions, as the analysed batch made it."""

    module: int  # id of the module
    shapes: tuple  # (shape, dtype) of its tensor arguments
    handed: bool  # left to the tap: no capture
    expand: bool  # its shared leading rows expanded to the batch
    output: tuple | None  # the shape of its captured output; None: not captured
    rows: Layout | None  # a row-by-row call's layout, where not one row per example
    before: int  # autograd nodes made since the previous event, up to its start
    during: int | None  # ... up to its end; None where a region ran inside it


@dataclass(frozen=True)
class RegionCall:
    """One call of a region module, as the analysed batch made it."""

    module: int  # id of the module
    entry: tuple  # owner specs of its tensor arguments (None: no example's; (dim, m): a lane)
    exit: tuple  # owner specs of its tensor outputs
    steps: int  # the analysed calls of hooked modules inside it (a light region's: steps)
    before: int  # autograd nodes made since the previous event, up to its start
    light: tuple[Recipe, ...] | None = None  # a light region's reads (``replay/light.py``)
    during: int = 0  # autograd nodes made during the call
    routed: bool = False  # a light region whose rows it follows (``replay/routed.py``)
    open: bool = False  # routed, its reads matched by kind, as many as the batch makes
    constant: tuple[bool, ...] = ()  # which tensor arguments were made from constants alone
    # a light one's scalar reads on the host: (op, value, how each example's own value of a
    # branch on the batch's is computed, ``analysis.branches.Own``)
    hosts: tuple[tuple[str, object, object], ...] = ()


@dataclass(frozen=True)
class ChildCall:
    """One call of a traced region's child (``analysis/children.py``), as the analysed batch
    made it: the hooked calls inside it are the program's steps, run without the region's trace
    and tap (a light one's reads by its recipes), which take its outputs as owned as they
    were."""

    module: int  # id of the module
    shapes: tuple  # (shape, dtype) of its tensor arguments
    entry: tuple  # their owner specs, as the region's trace must find them
    out_shapes: tuple  # (shape, dtype) of its tensor outputs
    exit: tuple  # their owner specs, which the region's trace takes
    during: int  # autograd nodes made during the call
    light: RegionCall | None = None  # a light child's call, replayed as a light region's


@dataclass(frozen=True)
class Program:
    """What a replayed batch of one signature does: the analysed batch's outcome."""

    # in the order they began (a traced region's own calls left out, its children's kept)
    steps: tuple[Step | RegionCall | ChildCall, ...]
    requests: Requests | None  # which outputs the backward requests; None: read each batch
    checked: tuple[str, ...]  # parameters no call reached: their gradients must stay None
    uses: tuple[tuple[str, int], ...]  # calls serving each parameter (merged where several)
    tail: int  # autograd nodes made from the last event to the losses
    moves: int  # the record's moves to the fallback when made: a later one retires it
    regions: frozenset[int]  # ids of the region modules
    state: State  # the model's state as the analysed batch began (``state.py``)
    root: tuple[Recipe, ...] = ()  # reads outside every region call, by recipe (``replay/root.py``)
    hosts: tuple[tuple[str, object, object], ...] = ()  # scalars read on the host outside them
    children: frozenset[int] = frozenset()  # ids of the modules of the regions' children
    # whether the analysed batch read a number of its values as a plain one (``int(t)``), which
    # no trace follows through Python, or a boolean of them where the witness does not compare
    # it: each replayed batch's every example checked alone
    alone: bool = False
    # the booleans its forward read on the host up to the last of the batch's values (a branch
    # Python took for the whole batch), which each replayed example must read alone as well
    branches: tuple[bool, ...] = ()
    doubts: tuple[int, ...] = ()  # which of them are of the batch's values
    # a training step's requests, which ask for parameters too (``serve.Served.trained``),
    # read off the first replayed step's graph where ``requests`` hold for every batch
    trained: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def lit(self) -> bool:
        """Whether any read is served by recipe: a light region's, or the root's."""
        calls = (s.light if isinstance(s, ChildCall) else s for s in self.steps)
        return bool(self.root) or any(
            isinstance(c, RegionCall) and c.light is not None for c in calls
        )

    @functools.cached_property
    def varies(self) -> bool:
        """Whether what a replayed batch calls and reads differs batch to batch: a region that
        is not light runs the trace and the tap again; an open one reads as the batch says."""
        return any(isinstance(s, RegionCall) and (s.light is None or s.open) for s in self.steps)
