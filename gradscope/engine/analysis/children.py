"""The children of a traced region: the module calls inside it that a replayed batch runs as it
runs the forward outside the regions, so that the region's trace and tap cover only what it does
around them (a model whose top reads the batch's values on the host, its layers replayed;
``replay/session.py``).

A call inside a traced region is a child where nothing inside it needed the analysis (no read of
a parameter outside its module's calls, no rows picked by values, no value read on the host: a
plain child, replayed with module hooks alone, where it calls a hooked module), or only what a light region serves (reads by
recipe, scalars read on the host that its witness compares: a light child, replayed as a light
region is); where nothing it read from before it began but its arguments, nothing it made or
wrote in place was read after its end but its outputs; its arguments and outputs owned as a lane
or by no example, and every output by examples (the trace picks up from there, and the tap
follows nothing out of it). Every call of its module must be one, and no hooked module is one
(its call is a step of its own). A child inside a child is its outer one's.
"""

from __future__ import annotations

from ..recipes import Recipe
from .chosen import Regions
from .finder import Finder
from .trace import IRREGULAR
from .visits import Visit, above

Child = tuple[Recipe, ...] | None  # a light child's recipes, or None for a plain one


def children_of(
    finder: Finder, regions: Regions, hooked: frozenset[int]
) -> dict[int, tuple[Recipe, ...] | None]:
    """The children of the traced regions by id of the visit (``Regions.children``): None for
    a plain one, a light one's recipes."""
    traced = {id(v) for v in regions.visits if id(v) not in regions.light}
    if not traced:
        return {}
    needy = {id(v) for _, stack, _, _ in finder.needs for v in stack}
    needy |= {id(v) for *_, stack in finder.hosts for v in stack}
    fit: dict[int, Child] = {}
    for v in finder.visits:
        if any(id(u) in traced for u in above(v)) and _ends(v, hooked):
            if id(v) not in needy and v.steps:  # ops alone cost more to step around than trace
                fit[id(v)] = None
            elif not finder.routed(v) and (recipes := finder.light(v)) is not None:
                fit[id(v)] = recipes
    # every call of a child's module is one: its hooks see no other
    unfit = {id(v.module) for v in finder.visits if id(v) not in fit}
    chosen: dict[int, Child] = {}
    for v in finder.visits:  # parents before their children
        outer = not any(id(u) in chosen for u in above(v))
        if id(v) in fit and id(v.module) not in unfit and outer:
            chosen[id(v)] = fit[id(v)]
    return chosen


def _ends(v: Visit, hooked: frozenset[int]) -> bool:
    """Whether a call's ends let it be a child: what it takes and gives is owned as a lane or
    by no example, what it gives by examples, and it reached no tensor another way."""
    return (
        id(v.module) not in hooked
        and not v.foreign
        and not v.leaks
        and v.entry != IRREGULAR
        and v.exit != IRREGULAR
        and bool(v.exit)
        and all(spec is not None for spec in v.exit)
    )
