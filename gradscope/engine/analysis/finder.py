"""Regions: the module calls of an analysed forward that later batches must analyse again.

Most of a forward replays with module hooks alone (``replay/session.py``). What does not is
kept to the smallest module calls that hold it, the regions, whose forward a replayed batch
runs under the trace and the tap again: a parameter read outside its module's calls (the tap's
reads, and the views and computations that lead to them), a call left to the tap (batch-free),
rows moved to places the batch's values pick (routing, masks, sorts), values of the batch read
on the host (Python may branch on them). A region is a module all of whose calls
- begin on tensors whose owners the replay can seed (the batch along one dimension, or no
  example's) and end on outputs it can check the same way: the rest of the forward replays on
  the analysed owners, so a batch whose region ends otherwise is analysed in full;
- read nothing the trace or the tap followed from before the call but its own arguments (an
  attribute set by a caller would reach the region unseen), and no watched view of a parameter
  made before the call.
A need whose every enclosing call fails these leaves the signature without a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..capture import counter, shapes_of
from ..constants import Constants
from ..recipes import Recipe
from ..tensors import tensors_of
from .bytensor import ByTensor
from .chosen import Regions
from .owners import padded_rows
from .tags import plain
from .trace import IRREGULAR
from .visits import Visit, above

if TYPE_CHECKING:
    from ..record import Record

PICKED = "picked"  # a need of rows the batch's values pick: a routed region follows them
ESCAPED = "escaped"  # the batch's values read on the host: an open routed region's, at most
WITNESSED = "witnessed"  # ... as one scalar, which a light region's witness compares


class Finder:
    """Watches every module call of one analysed forward: where each began and ended, what
    its tensors' owners were at both ends, what inside it needs analysis, and what it read
    from before it began. The trace and the tap report to it (``born``, ``read``, ``need``)."""

    def __init__(self, model: nn.Module, events: list, trace, derived, record: Record):
        self.model, self.events, self.trace, self.derived = model, events, trace, derived
        self.traced = record.traced  # module classes whose light regions did not hold
        self.witness = not record.branches  # whether values read on the host may be witnessed
        self.visits: list[Visit] = []
        self.stack: list[Visit] = []
        # (why, the visits under way, the recipe of a read that has one, autograd's counter)
        self.needs: list[tuple[str, tuple[Visit, ...], Recipe | None, int]] = []
        self.log: list[tuple[str, object, int]] = []  # (what, its event or visit, counter)
        self.hosts: list[tuple] = []  # (op, value, ``branches.Own``, the visits under way)
        self._born = ByTensor()  # tensor -> the innermost visit's index when it was made
        self.constants = Constants()  # the tap's: what was made from constants alone
        self._handles: list = []

    def __enter__(self) -> Finder:
        for module in self.model.modules():
            pre = module.register_forward_pre_hook(self._enter, with_kwargs=True)
            self._handles += [pre, module.register_forward_hook(self._exit)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- what the trace and the tap report ---------------------------------------------------

    def born(self, t: Tensor) -> None:
        """``t`` got owners (the trace) or became watched (the tap) now."""
        if t not in self._born:
            self._born[t] = self.stack[-1].index if self.stack else -1

    def read(self, tensors: Iterable[Tensor]) -> None:
        """An op inside the current visits read ``tensors`` (followed ones): each visit that
        began after one of them was made, and was not given it, read from before it began;
        each that made one and has ended, and did not return it, leaked it."""
        for t in tensors:
            b = self._born.get(t)
            if b is None:
                continue
            for v in self._after(b):
                v.foreign |= id(t) not in v.arg_ids
            u = self.visits[b] if b >= 0 else None
            while u is not None and u.done:
                u.leaks |= id(t) not in u.out_ids
                u = u.parent

    def wrote(self, t: object) -> None:
        """An op inside the current visits wrote ``t`` in place: each visit that began after it
        was made wrote past its end (where it was made during the write, a later read of it
        shows whether it leaked)."""
        b = self._born.get(t)
        for v in self._after(b) if b is not None else ():
            v.leaks = True

    def _after(self, b: int) -> Iterator[Visit]:
        """The visits under way that began after visit ``b`` (-1: none, the forward's top)."""
        for v in reversed(self.stack):
            if v.index <= b:
                return
            yield v

    def need(self, why: str, recipe: Recipe | None = None) -> None:
        """Something at this point of the forward needs analysis on every batch; ``recipe``:
        a read that a light region can serve again without it."""
        self.needs.append((why, tuple(self.stack), recipe, counter()))

    def picked(self, why: str) -> None:
        """Rows moved here to places the batch's values pick: a routed region follows them."""
        self.needs.append((why, tuple(self.stack), PICKED, counter()))

    def escaped(self, why: str) -> None:
        """The batch's values read on the host here: Python may branch on them, so a region
        holding this is traced, or, if routed, open (``replay/routed.py``)."""
        self.needs.append((why, tuple(self.stack), ESCAPED, counter()))

    def host(self, name: str, value: object, escaped: bool, own: tuple | None = None) -> None:
        """One scalar read from tensors' values on the host here by op ``name``; ``escaped``:
        the batch's values. A light region holding it reads the same on every replayed batch,
        or the batch is analysed (Python may have branched otherwise); ``own``: a branch's
        examples' own values, as ``branches.py`` computes them."""
        self.hosts.append((name, plain(value), own, tuple(self.stack)))
        if escaped:  # where such values differed before: traced again, as any escape
            need = WITNESSED if self.witness else ESCAPED
            self.need(f"the batch's values read on the host ({name})", need)

    # -- the hooks ---------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with torch._C.DisableTorchFunction():
            tensors = tensors_of((args, kwargs))
            v = Visit(
                module,
                len(self.visits),
                self.stack[-1] if self.stack else None,
                len(self.events),
                counter(),
                frozenset(id(t) for t in tensors),
                self._specs(tensors),
                constant=tuple(t in self.constants for t in tensors),
                shapes=shapes_of(tensors),
            )
        self.visits.append(v)
        self.stack.append(v)
        self.log.append(("enter", v, v.at_entry))

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        v = self.stack.pop()
        with torch._C.DisableTorchFunction():
            v.steps, v.at_exit = len(self.events) - v.first, counter()
            outputs = tensors_of(output)
            if v.parent is None:
                self._padded(outputs)
            v.exit, v.out_shapes = self._specs(outputs), shapes_of(outputs)
            v.out_ids, v.done = frozenset(id(t) for t in outputs), True
        self.log.append(("exit", v, v.at_exit))

    def _padded(self, outputs: list[Tensor]) -> None:
        """The model's outputs whose row i is example i's or none's, element by element (a padded
        sequence's), taken as the batch along dimension 0: the losses' owners then hold wherever
        a replayed batch's padding lies (``seeded.py`` checks its end the same way)."""
        trace = self.trace
        for t in outputs:
            o = trace.owners.get(t)
            if o is not None and trace.spec(t) == IRREGULAR and padded_rows(o, trace.batch):
                trace.owners[t] = trace.lane_owners(t.dim(), (0, 1), t.shape[0])

    def _specs(self, tensors: list[Tensor]) -> tuple | str:
        """Each tensor's owner spec, or IRREGULAR where one is a watched view of a parameter or
        has owners the replay cannot seed."""
        specs = []
        for t in tensors:
            spec = IRREGULAR if t in self.derived else self.trace.spec(t)
            if spec == IRREGULAR:
                return IRREGULAR
            specs.append(spec)
        return tuple(specs)

    # -- the choice --------------------------------------------------------------------------

    def choose(self, start: int, whole: bool = False) -> Regions | str:
        """The regions that cover every need, and the reads no call around them can hold that
        the replay serves by recipe (each with the autograd nodes made since ``start``, the
        forward's); or why there are none (a need that no call around it, the model's own
        call aside unless ``whole``, can hold, and no recipe serves). Where that traces a
        region on every batch, the reads whose own call cannot hold them are served at the root
        instead (Mistral Large 4's rotary table, made from a learned ``alpha`` in one call and
        read in every layer: no call but the model's holds them), if less is traced then."""
        regions = self._choice(start, whole, rooted=False)
        if isinstance(regions, str) or whole or not regions.traced:
            return regions
        rooted = self._choice(start, whole, rooted=True)
        return regions if isinstance(rooted, str) or rooted.traced >= regions.traced else rooted

    def _choice(self, start: int, whole: bool, rooted: bool) -> Regions | str:
        """``choose``'s regions; ``rooted``: a read with a recipe whose own call cannot hold
        it is served at the root, unless a region chosen for another need holds it."""
        chosen: set[int] = set()
        root: list[Recipe] = []
        later: list[tuple[Recipe, int, tuple[Visit, ...]]] = []
        for why, stack, recipe, at in self.needs:
            if recipe is WITNESSED:  # compared on every batch: by its region, or the root
                continue
            if rooted and _plain(recipe) and stack and not self._holds(stack[-1].module):
                later.append((recipe, at, stack))
                continue
            for v in reversed(stack):
                if (whole or v.parent is not None) and self._holds(v.module):
                    chosen.add(id(v.module))
                    break
            else:
                if not _plain(recipe):
                    return f"{why}, outside any module call a region can hold"
                root.append(dataclasses.replace(recipe, at=at - start))
        for recipe, at, stack in later:
            if not any(id(v.module) in chosen for v in stack):
                root.append(dataclasses.replace(recipe, at=at - start))
        root.sort(key=lambda r: r.at)
        outer = [
            v
            for v in self.visits
            if id(v.module) in chosen and not any(id(u.module) in chosen for u in above(v))
        ]
        light = {id(v): r for v in outer if (r := self.light(v)) is not None}
        routed = frozenset(id(v) for v in outer if id(v) in light and self.routed(v))
        opened = frozenset(i for i in routed if any(r.expert for r in light[i]))
        opened |= frozenset(id(v) for v in outer if id(v) in routed and self._escaped(v))
        hosts = {
            i: tuple(h[:3] for h in self.hosts if v in h[3])
            for v in outer
            if (i := id(v)) in light and i not in routed
        }
        inside = {id(v) for v in outer}
        top = tuple(h[:3] for h in self.hosts if not any(id(v) in inside for v in h[3]))
        return Regions(frozenset(chosen), outer, light, routed, opened, tuple(root), hosts, top)

    def light(self, v: Visit) -> tuple[Recipe, ...] | None:
        """The recipes of a region call whose every need is a read with one, or a scalar of
        the batch's values read on the host (its witness compares them; in a routed region, rows
        picked by values, or any values read), each with the autograd nodes made from the
        call's start to the read's end; None for any other."""
        mine = [(recipe, at) for _, stack, recipe, at in self.needs if v in stack]
        if not mine or type(v.module) in self.traced or any(r is None for r, _ in mine):
            return None
        computed = any(isinstance(r, Recipe) and r.computed for r, _ in mine)
        unfit = not self._routable_steps(v) or computed or not _rows_first(v)
        if self.routed(v) and unfit:  # a routed region follows rows alone: no call inside
            return None  # but those it holds (``replay/hooked.py``), nothing made from parameters
        unwitnessed = self._escaped(v, witnessed=False)
        expert = any(isinstance(r, Recipe) and r.expert for r, _ in mine)
        if not self.routed(v) and (unwitnessed or expert):
            return None
        reads = [(r, at) for r, at in mine if r not in (PICKED, ESCAPED, WITNESSED)]
        return tuple(dataclasses.replace(recipe, at=at - v.at_entry) for recipe, at in reads)

    def _routable_steps(self, v: Visit) -> bool:
        """Whether every hooked call inside the region call is one a routed region holds, on
        rows of its own: an ``nn.Linear``'s, or one its rule reads by bags (``replay/hooked.py``)."""
        inner = self.events[v.first : v.first + v.steps]
        held = (type(e.module) is nn.Linear or e.bags for e in inner)
        return all(held) and not any(e.handed or e.expand for e in inner)

    def routed(self, v: Visit) -> bool:
        """Whether a region call's rows are picked by values: a routed region's, if light."""
        mine = [recipe for _, stack, recipe, _ in self.needs if v in stack]
        return any(
            r is PICKED or (isinstance(r, Recipe) and (r.op == "grouped_mm" or r.expert))
            for r in mine
        )

    def _escaped(self, v: Visit, witnessed: bool = True) -> bool:
        """Whether the call read the batch's values on the host (``witnessed``: as scalars too)."""
        kinds = (ESCAPED, WITNESSED) if witnessed else (ESCAPED,)
        return any(r in kinds for _, stack, r, _ in self.needs if v in stack)

    def _holds(self, module: nn.Module) -> bool:
        """Whether every call of ``module`` can be a region."""
        calls = [v for v in self.visits if v.module is module]
        return all(v.entry != IRREGULAR and v.exit != IRREGULAR and not v.foreign for v in calls)


def _plain(recipe: object) -> bool:
    """Whether a need is a read a light region's recipe serves on rows laid out by shapes."""
    return isinstance(recipe, Recipe) and not (recipe.expert or recipe.op == "grouped_mm")


def _rows_first(v: Visit) -> bool:
    """Whether every tensor a call begins and ends with is no example's, or the batch along
    dimension 0: the rows a routed region follows."""
    return all(spec is None or spec[0] == 0 for spec in (*v.entry, *v.exit))
