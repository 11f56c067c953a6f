"""The replay program of an analysed batch (``replay/session.py``): its calls outside the regions
and its region calls in the order they began, with the autograd nodes made between any two of
them (the witness), where later batches of the signature may repeat it; and, where they may
not, why. Its ``structure``, what it holds but the state its batch began in, tells a batch
analysed again whose program is one already self-checked (``alike``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..backward.backward import Requests
from ..steps import ChildCall, Program, RegionCall, Step
from .analyse import Analysed
from .children import children_of
from .chosen import Regions
from .session import Entered
from .visits import Visit


@dataclass
class _Open:
    """A step being written: its start seen, its end not yet."""

    event: Entered
    before: int
    during: int | None = None
    spans_region: bool = False  # a region began inside it: what it made differs batch to batch


def regions_of(captured: Analysed) -> Regions | str:
    """The regions a later batch analyses again, with their children; or why no later batch
    may replay this one. Where no other call holds a need, the model's own call is the region
    (BART's classifier's pick of its end tokens, a packed RNN's sort of its rows): traced on
    every batch around its children, if any, it still costs less than an analysis, which also
    decides, writes the program and self-checks a structure it has not seen. A light one
    (routed: a top-level ``argsort``) is the region only where it has children, or where it
    holds a call whose rule reads bags (a packed RNN, an EmbeddingBag on offsets), which the
    replay follows its rows to (``replay/packrows.py``) instead of tracing the forward."""
    finder, hooked = captured.finder, frozenset(id(m) for m in captured.session.modules)
    regions = finder.choose(captured.at_start)
    if isinstance(regions, str):
        whole = finder.choose(captured.at_start, whole=True)
        if isinstance(whole, str) or (whole.light and not _bagged(captured, whole)):
            children = {} if isinstance(whole, str) else children_of(finder, whole, hooked)
            if not children:
                return regions
        regions = whole
    regions = dataclasses.replace(regions, open=regions.open | _bagged(captured, regions))
    return dataclasses.replace(regions, children=children_of(finder, regions, hooked))


def _bagged(captured: Analysed, regions: Regions) -> frozenset[int]:
    """The routed region calls among ``regions`` that hold a call whose rule reads bags: open,
    as a packed RNN's kernels make as many autograd nodes as the batch's lengths say."""
    events = captured.finder.events
    return frozenset(
        id(v)
        for v in regions.visits
        if id(v) in regions.routed and any(e.bags for e in events[v.first : v.first + v.steps])
    )


def program_of(
    captured: Analysed,
    regions: Regions,
    requests: Requests | None,
    checked: tuple[str, ...],
    uses: dict[str, int],
    moves: int,
) -> Program:
    """The program of an analysed batch with these ``regions``: the finder's log of events,
    less what ran inside a region but in its children."""
    starts = {id(v) for v in regions.visits}
    items: list[_Open | RegionCall | ChildCall] = []
    opened: dict[int, _Open] = {}
    inside: Visit | None = None  # the region call under way
    own = False  # whether its hooked calls are the region's own (traced or routed)
    child: Visit | None = None  # the traced region's child under way: its calls are steps
    last = captured.at_start
    for what, obj, at in captured.finder.log:
        if what == "enter" and own and child is None and id(obj) in regions.children:
            items.append(_child(obj, regions.children[id(obj)], captured))
            child, own = obj, False
        elif what == "exit" and obj is child:
            child, own = None, True
        elif what == "pre" and not own:
            item = opened[id(obj)] = _Open(obj, at - last)
            items.append(item)
        elif what == "post" and id(obj) in opened:
            item = opened.pop(id(obj))
            item.during = None if item.spans_region else at - last
        elif what == "enter" and inside is None and id(obj) in starts:
            region = _region(obj, regions, at - last)
            items.append(region)
            inside, own = obj, region.light is None or region.routed
            for item in opened.values():
                item.spans_region = True
        elif what == "exit" and obj is inside:
            inside, own = None, False
        else:
            continue
        last = at
    steps = tuple(_step(i) if isinstance(i, _Open) else i for i in items)
    children = frozenset(s.module for s in steps if isinstance(s, ChildCall))
    tail = captured.at_end - last
    asked, doubts, unseen = _branches(captured, regions)
    return Program(
        steps,
        requests,
        checked,
        tuple(uses.items()),
        tail,
        moves,
        regions.modules,
        captured.state,
        regions.root,
        regions.root_hosts,
        children,
        captured.trace.noted.lost or unseen,
        asked,
        doubts,
    )


def _branches(captured: Analysed, regions: Regions) -> tuple[tuple, tuple[int, ...], bool]:
    """The booleans each example of a replayed batch must read alone (``branches.py``), which
    of them are of the batch's values, and whether one of those is read where the replay's
    witness does not compare it (inside a region call traced or routed), so that every example
    is run whole instead."""
    branches, hosts = captured.trace.branches, captured.finder.hosts
    traced = {
        id(v) for v in regions.visits if id(v) not in regions.light or id(v) in regions.routed
    }
    unseen = any(
        h is not None and any(id(v) in traced for v in hosts[h][3])
        for h in branches.hosts[: branches.doubted]
    )
    return ((), (), True) if unseen else (branches.asked, tuple(branches.doubts), False)


def _region(v: Visit, regions: Regions, before: int) -> RegionCall:
    """The program's entry for a region call, begun ``before`` autograd nodes after the last
    event."""
    light, during = regions.light.get(id(v)), v.at_exit - v.at_entry
    routed, is_open = id(v) in regions.routed, id(v) in regions.open
    hosts = regions.hosts.get(id(v), ())
    return RegionCall(
        id(v.module), v.entry, v.exit, v.steps, before, light, during, routed, is_open,
        v.constant, hosts,
    )  # fmt: skip


def _child(v: Visit, recipes: tuple | None, captured: Analysed) -> ChildCall:
    """The program's entry for a child: a light one's call as a light region's."""
    during, light = v.at_exit - v.at_entry, None
    if recipes is not None:
        hosts = tuple(h[:3] for h in captured.finder.hosts if v in h[3])
        light = RegionCall(
            id(v.module), v.entry, v.exit, v.steps, 0, recipes, during, constant=v.constant,
            hosts=hosts,
        )  # fmt: skip
    return ChildCall(id(v.module), v.shapes, v.entry, v.out_shapes, v.exit, during, light)


def _step(item: _Open) -> Step:
    e, c = item.event, item.event.call
    shape = None if c is None else tuple(c.shape)
    rows = None if c is None else c.rows
    return Step(id(e.module), e.shapes, e.handed, e.expand, shape, rows, item.before, item.during)


# what a program holds of its batch rather than of its structure
_OF_BATCH = frozenset({"state", "trained"})


def structure(program: Program) -> tuple:
    """What ``program`` holds but the state its batch began in: each step's module, argument
    shapes and dtypes, output shape, layout of rows and autograd nodes before and during it;
    each region call's owners at its ends, recipes and values read on the host; the children,
    requests, uses, the nodes after the last event, and the record's moves to the fallback
    when it was made (which rule serves each parameter). Two analysed batches of one
    structure ran the same ops on the same shapes outside the hooked calls, read the same
    parameters the same way, and were served by the same rules on the same rows."""
    return tuple(
        getattr(program, f.name) for f in dataclasses.fields(program) if f.name not in _OF_BATCH
    )


def repeated(program: Program | str, known: list[tuple]) -> bool:
    """Whether ``program`` (a string: none made) is of one of the structures ``known``."""
    return not isinstance(program, str) and any(alike(structure(program), k) for k in known)


def alike(a: object, b: object) -> bool:
    """Whether two structures (or parts of them) are equal: tensors among them (a gather's
    rows, a product's slots, a broadcast's elements) by dtype, shape and values; dataclasses
    field by field, those their own ``==`` leaves out too; containers entry by entry."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
            and torch.equal(a, b)
        )
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        fields = dataclasses.fields(a)
        return all(alike(getattr(a, f.name), getattr(b, f.name)) for f in fields)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k]) for k in a)
    return a == b
