"""What the analysis chose (``finder.py``'s ``Finder.choose``): the regions of a forward, the
light, routed and open ones among them, and the reads served by recipe outside every region."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..recipes import Recipe
from .visits import Visit


@dataclass
class Regions:
    """The visits whose module is a region, per module, in the order they began; and of those
    that are light (``replay/light.py``: their only needs are reads a recipe serves; the calls
    of hooked modules inside them replay as the program's steps), the recipes, by id of the
    visit; of those, the ones whose rows the batch's values pick (``replay/routed.py``, with
    no hooked module called inside)."""

    modules: frozenset[int] = frozenset()
    visits: list[Visit] = field(default_factory=list)
    light: dict[int, tuple[Recipe, ...]] = field(default_factory=dict)
    routed: frozenset[int] = frozenset()
    open: frozenset[int] = frozenset()  # routed, their reads differing in number batch to batch
    root: tuple[Recipe, ...] = ()  # reads outside every region call, served by recipe
    # of the light ones not routed, by id of the visit: every read of one scalar from tensors'
    # values on the host, (op, what it read, ``branches.Own``), in order; a replayed call must
    # read the same
    hosts: dict[int, tuple[tuple[str, object, object], ...]] = field(default_factory=dict)
    root_hosts: tuple[tuple[str, object, object], ...] = ()  # those outside every region call
    # the calls inside traced regions that replay as the rest of the forward, by id of the
    # visit: None, or a light child's recipes (``children.py``)
    children: dict[int, tuple[Recipe, ...] | None] = field(default_factory=dict)

    @property
    def fixed(self) -> bool:
        """Whether a replayed batch makes the analysed calls and reads, in the analysed order:
        no region, or light ones alone, none open (an open one reads as many as its batch's
        routing makes), none routed around hooked calls (``replay/hooked.py`` serves their
        Linears as the region's reads, calls in the analysed batch): elsewhere which outputs
        the backward must request is read each batch."""
        return all(
            id(v) in self.light
            and id(v) not in self.open
            and not (id(v) in self.routed and v.steps)
            for v in self.visits
        )

    @property
    def traced(self) -> int:
        """The autograd nodes made in the calls traced on every batch (not light)."""
        return sum(v.at_exit - v.at_entry for v in self.visits if id(v) not in self.light)
