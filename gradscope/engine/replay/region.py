"""A region call under way in a replayed batch (``session.py``), and the replay's hooks on the
region modules and on their children's (``analysis/children.py``): a region call begins its own
pass (a light region's, a routed one's, or the trace and the tap again: ``make_region``), and
inside a traced one a child's call takes them off while its hooked calls replay as steps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..capture import counter, shapes_of
from ..steps import ChildCall, RegionCall
from ..tensors import tensors_of


class Region:
    """A region call under way in a replayed batch: its own analysis (``analysis.Region``,
    which the engine makes) and where it stands."""

    def __init__(self, call: RegionCall, analysis: Any, module: nn.Module):
        self.call, self.analysis, self.module = call, analysis, module
        self.depth = 1  # calls of its module under way (a module may call itself)
        # the hooked calls inside it are its own (traced, or routed: none), not the program's
        self.own = call.light is None or call.routed
        # a traced region's child under way: its step, module, calls of it under way, start,
        # and a light one's own pass
        self.child: ChildCall | None = None
        self.child_module: nn.Module | None = None
        self.child_depth, self.child_start = 0, 0
        self.child_light: Any = None

    @property
    def owns(self) -> bool:
        """Whether a hooked call beginning now is the region's own (none is in a child)."""
        return self.own and self.child is None


class RegionHooks:
    """The replay's hooks on the region and child modules (``ReplaySession`` is one): uses its
    ``region``, ``steps``, ``next``, ``make_region``, ``done``, ``diverge``, ``_ticked``,
    ``_spent`` and ``_last``."""

    def _region_enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A region module's call begins: its own analysis, or a call within its region."""
        if self.region is not None:
            self.region.depth += module is self.region.module
            return
        self._spent()
        call = self.steps[self.next] if self.next < len(self.steps) else None
        if not isinstance(call, RegionCall) or call.module != id(module):
            self.diverge(f"another region than the analysed batch's: {type(module).__name__}")
        self._ticked(call.before, "before", module)
        self.next += 1
        tensors = tensors_of((args, kwargs))
        if len(tensors) != len(call.entry):
            self.diverge(f"other arguments of {type(module).__name__}")
        self.region = Region(call, self.make_region(call, tensors), module)

    def _region_exit(self, module: nn.Module, args: tuple, output: object) -> None:
        region = self.region
        if region is None or module is not region.module:
            return
        region.depth -= 1
        if region.depth:
            return
        self.region = None
        outputs = tensors_of(output)
        why = region.analysis.finish(outputs, region.call.exit)
        if why:
            self.diverge(f"{why} in {type(module).__name__}")
        self.done.append(region.analysis)
        self._last = counter()  # what the region made differs from batch to batch

    def _child_enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A child of a traced region begins (``analysis/children.py``): the region's trace
        and tap off until it ends, where its arguments are as analysed, owners and all."""
        region, name = self.region, type(module).__name__
        if region is None or region.call.light is not None:
            self.diverge(f"a call of {name} outside the region it ran in")
        if region.child is not None:  # a call inside the child: the child's
            region.child_depth += module is region.child_module
            return
        step = self.steps[self.next] if self.next < len(self.steps) else None
        if not isinstance(step, ChildCall) or step.module != id(module):
            self.diverge(f"another call than the analysed batch's in a region: {name}")
        tensors = tensors_of((args, kwargs))
        if shapes_of(tensors) != step.shapes:
            self.diverge(f"a call of {name} on other shapes")
        with torch._C.DisableTorchFunction():
            owned = all(map(region.analysis.owned, tensors, step.entry))
        if not owned:
            self.diverge(f"a call of {name} on arguments owned otherwise than analysed")
        if not region.analysis.pause():
            self.diverge(f"a torch function mode of the model's own around a call of {name}")
        self.next += 1
        region.child, region.child_module, region.child_depth = step, module, 1
        region.child_start = self._last = counter()
        if step.light is not None:  # its reads by its recipes, under a mode of its own
            region.child_light = self.make_region(step.light, tensors)

    def _child_exit(self, module: nn.Module, args: tuple, output: object) -> None:
        """A child's call ends: its outputs owned as analysed, for the region's trace."""
        region = self.region
        if region is None or region.child is None or module is not region.child_module:
            return
        region.child_depth -= 1
        if region.child_depth:
            return
        step, light = region.child, region.child_light
        region.child = region.child_light = None
        outputs = tensors_of(output)
        why = None if light is None else light.finish(outputs, step.exit)
        region.analysis.resume()
        name = type(module).__name__
        if why:
            self.diverge(f"{why} in {name}")
        if light is not None:
            self.done.append(light)
        if counter() - region.child_start != step.during:
            self.diverge(f"other operations than the analysed batch's in a call of {name}")
        if shapes_of(outputs) != step.out_shapes:
            self.diverge(f"a call of {name} with other outputs")
        region.analysis.seed(outputs, step.exit)
        self._last = counter()
