"""Routed regions: a light region (``light.py``) whose rows the batch's values pick, as routed
experts' are (tokens sorted by expert, gathered, run by ``grouped_mm`` on a fused 3-D weight, put
back). A replayed batch runs the call under ``RoutedRegion``: the recipes' reads served as a
light region serves them, the grouped ones by ``rules/routed.py`` on rows whose examples
``rowflow.py`` follows from the call's arguments, op by op, on the device.

The witness of a routed call: a light region's (the reads in the analysed order, as many
autograd nodes), every read's rows some example's, a recipe's lanes where it has them, and the
outputs' rows those the analysed batch ended with. What the values decide is a flag the replay
reads once, at the forward's end (the one host sync these regions add); a tensor the rows could
not be followed to, at a read or an output, sends the batch to the analysis and the module's
class to the trace for good (``Record.unrouted``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...rules.routed import Routed
from ..capture import Use, counter, edge, read_at
from ..plan import Plan
from .light import LightRegion, Recipe, _metadata, _name, bind_affine, viewed_parts
from .rowflow import NO_ONE, RowFlow, tensors_in


class RoutedRegion(LightRegion):
    """One routed region call of a replayed batch: its ``tensors`` and their owner specs at
    ``entry`` (None: no example's; (0, m): rows (r // m) % B), the specs its outputs must end
    with at ``exit``; ``unfollowed`` is told when a tensor it cannot follow reaches a read or
    an output."""

    def __init__(
        self,
        plan: Plan,
        recipes: Sequence[Recipe],
        during: int,
        batch: int,
        tensors: Sequence[Tensor],
        entry: tuple,
        unfollowed: Callable[[], None],
    ):
        self.flow = RowFlow(batch)
        self.views: dict[int, tuple[Tensor, Tensor]] = {}  # W^T of a watched W -> (view, W)
        self.unfollowed = unfollowed
        for t, spec in zip(tensors, entry, strict=True):
            if spec is not None:
                self.flow.keep(t, self.flow.lane(t, spec))
        super().__init__(plan, recipes, during, batch)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _metadata(func):
            return func(*args, **kwargs)
        name = _name(func)
        if name == "__get__":
            name = _name(func.__self__)
        ts = tensors_in(args, kwargs)
        watched = [t for t in ts if id(t) in self.watched or self._view(t) is not None]
        out = self._watched(name, func, args, kwargs) if watched else func(*args, **kwargs)
        if self.flow.holds(ts):
            with torch._C.DisableTorchFunction():
                self.flow.follow(name, args, kwargs, out)
        return out

    # -- reads of the watched parameters ----------------------------------------------------

    def _view(self, t: object) -> Tensor | None:
        item = self.views.get(id(t))
        return item[1] if item is not None and item[0] is t else None

    def _watched(self, name: str, func, args: tuple, kwargs: dict):
        if name in ("transpose", "swapaxes", "mT") and args and id(args[0]) in self.watched:
            out = func(*args, **kwargs)
            d = [a % args[0].dim() for a in args[1:3]] if name != "mT" else [1, 2]
            if args[0].dim() == 3 and sorted(d) == [1, 2]:
                self.views[id(out)] = (out, args[0])
            else:
                self.why = self.why or f"another read than the analysed batch's ({name})"
            return out
        if name in ("grouped_mm", "_grouped_mm"):
            return self._grouped(func, args, kwargs)
        if any(self._view(t) is not None for t in tensors_in(args, kwargs)):
            self.why = self.why or f"another read than the analysed batch's ({name})"
            return func(*args, **kwargs)
        done = self._next
        out = LightRegion.__torch_function__(self, func, (), args, kwargs)
        if self._next > done:  # a recipe's read: its rows as the recipe lays them out
            self._lanes_hold(self.recipes[done], bind_affine(name, args, kwargs)[0])
        return out

    def _lanes_hold(self, recipe: Recipe, x: Tensor) -> None:
        rows = self._rows_at(x)
        lanes = recipe.rows
        if rows is None:
            return
        if lanes is not None and lanes.dim != 0:
            self.why = self.why or "rows laid out along another dimension in a routed region"
            return
        self.flow.flag(rows != self.flow.lane(x, (0, 1 if lanes is None else lanes.m)))

    def _grouped(self, func, args: tuple, kwargs: dict) -> Tensor:
        x, weight = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        view = self._view(weight)
        param, transposed = (view, False) if view is not None else (weight, True)
        recipe = self.recipes[self._next] if self._next < len(self.recipes) else None
        out = func(*args, **kwargs)
        extra = len(args) > 3 or any(v is not None for k, v in kwargs.items() if k != "offs")
        if (
            recipe is None
            or recipe.op != "grouped_mm"
            or recipe.transposed != transposed
            or tuple(x.shape) != recipe.shape
            or param is not self.params[recipe.roles[0][1]].param
            or offs is None
            or extra
        ):
            self.why = self.why or "another read than the analysed batch's (grouped_mm)"
            return out
        self._next += 1
        if counter() - self._start != recipe.at:
            self.why = self.why or "other operations before a read than the analysed batch's"
        rows = self._rows_at(x)
        if rows is None or not out.requires_grad:
            return out
        self.flow.flag(rows < 0)
        a, p, batch = x.detach(), self.params[recipe.roles[0][1]], self.batch

        def parts(grad: Tensor) -> dict:
            return {p.name: Routed.of(a, grad, rows, offs, param.shape, batch, transposed)}

        target, viewed = read_at(out, [x, weight])
        with torch._C.DisableTorchFunction():
            use = Use((p,), edge(target), parts if viewed is None else viewed_parts(parts, viewed))
            self.hooks.add(target, use)
        self.uses.append(use)
        return out

    def _rows_at(self, x: Tensor) -> Tensor | None:
        """The rows of a read's input; None (and the region unfollowed) where not followed."""
        rows = self.flow.of(x)
        if rows is None or rows is False:
            rows = None
            self.why = self.why or f"rows the replay cannot follow ({self.flow.lost or 'none'})"
            self.unfollowed()
        return rows

    # -- the end ---------------------------------------------------------------------------

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        why = super().finish(outputs, exit)
        if why or len(outputs) != len(exit):
            return why
        for t, spec in zip(outputs, exit, strict=True):
            rows = self.flow.of(t)
            if rows is None:
                self.unfollowed()
                return f"rows the replay cannot follow ({self.flow.lost or 'none'})"
            if spec is None:
                if rows is not False:
                    self.flow.flag(rows != NO_ONE)
            elif rows is False or spec[0] != 0:
                self.unfollowed()
                return "outputs owned otherwise than the analysed batch's"
            else:
                self.flow.flag(rows != self.flow.lane(t, spec))
        self.flow.rows.clear()
        return None

    def pending(self) -> Tensor | None:
        return self.flow.bad
