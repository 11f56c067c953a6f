"""The children of a traced region: the module calls inside it that a replayed batch runs as it
runs the forward outside the regions, with module hooks alone, so that the region's trace and
tap cover only what it does around them (a model whose top reads the batch's values on the host,
its decoder layers replayed; ``passes/replay.py``).

A call inside a traced region is a child where nothing inside it needed the analysis: no read of
a parameter outside its module's calls, no rows picked by values, no value read on the host (of
the batch's or any other: Python branches on none), nothing read from before it began but its
arguments, nothing it made or wrote in place read after its end but its outputs; its arguments and outputs owned as a lane or by no example, and every output by
examples (the trace picks up from there, and the tap follows nothing out of it). Every call of
its module must be one, and no hooked module is one (its call is a step of its own). A child
inside a child is its outer one's.
"""

from __future__ import annotations

from .regions import Finder, Regions
from .trace import IRREGULAR
from .visits import Visit, above


def children_of(finder: Finder, regions: Regions, hooked: frozenset[int]) -> frozenset[int]:
    """The ids of the visits that are children of the traced regions (``Regions.children``)."""
    traced = {id(v) for v in regions.visits if id(v) not in regions.light}
    if not traced:
        return frozenset()
    needy = {id(v) for _, stack, _, _ in finder.needs for v in stack}
    needy |= {id(v) for _, _, stack in finder.hosts for v in stack}
    fit = {
        id(v)
        for v in finder.visits
        if any(id(u) in traced for u in above(v)) and _clean(v, needy, hooked)
    }
    # every call of a child's module is one: its hooks see no other
    unfit = {id(v.module) for v in finder.visits if id(v) not in fit}
    chosen: set[int] = set()
    for v in finder.visits:  # parents before their children
        outer = not any(id(u) in chosen for u in above(v))
        if id(v) in fit and id(v.module) not in unfit and outer:
            chosen.add(id(v))
    return frozenset(chosen)


def _clean(v: Visit, needy: set[int], hooked: frozenset[int]) -> bool:
    return (
        id(v.module) not in hooked
        and id(v) not in needy
        and not v.foreign
        and not v.leaks
        and v.entry != IRREGULAR
        and v.exit != IRREGULAR
        and bool(v.exit)
        and all(spec is not None for spec in v.exit)
    )
