"""Routed regions: a light region (``light.py``) whose rows the batch's values pick, as routed
experts' are (tokens sorted by expert, gathered, run by ``grouped_mm`` on a fused 3-D weight, put
back), a packed RNN's and an EmbeddingBag's cut by offsets. A replayed batch runs the call under
``RoutedRegion``: the recipes' reads served as a light region serves them, the grouped ones by
``rules/routed.py`` on rows whose examples ``rowflow.py`` follows from the call's arguments, op
by op, on the device.

The witness of a routed call: a light region's (the reads in the analysed order, as many
autograd nodes), every read's rows some example's, a recipe's lanes where it has them, and the
outputs' rows those the analysed batch ended with. What the values decide is a flag the replay
reads once, at the forward's end (the one host sync these regions add, none where the rows'
forms settle every check: ``forms.py``); a tensor the rows could not be followed to, at a read
or an output, sends the batch to the analysis and the module's class to the trace for good.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...rules.routed import Routed
from ..capture import Use, counter, edge, read_at
from ..ops import BIASED, CASTS, EXPERT_READS, EXPERT_VIEWS, op_name
from ..parts import bind_affine, broadcast_view, viewed_parts
from ..plan import Plan
from ..recipes import ARG, Recipe, metadata
from ..tensors import tensors_in
from .byid import ByIdReads, by_id
from .hooked import HookedCalls
from .light import LightRegion
from .rowflow import NO_ONE, RowFlow


class RoutedRegion(ByIdReads, HookedCalls, LightRegion):
    """One routed region call of a replayed batch: its ``tensors`` and their owner specs at
    ``entry`` (None: no example's; (0, m): rows (r // m) % B); ``during`` None for an open one,
    whose reads are matched by kind, as many as the batch makes; ``unfollowed`` is told when a
    tensor the rows cannot be followed to reaches a read or an output; ``copy``: the modules
    whose bag calls' inputs are copied (``hooked.py``); ``root``: the model's own call, whose
    outputs' rows may be none's (a bag of no ids: as ``seeded.py`` ends a traced root)."""

    def __init__(
        self,
        plan: Plan,
        recipes: Sequence[Recipe],
        during: int | None,
        batch: int,
        tensors: Sequence[Tensor],
        entry: tuple,
        unfollowed: Callable[[], None],
        copy: set[int],
        root: bool = False,
    ):
        self.flow = RowFlow(batch)
        self.open = during is None
        # views of a watched 3-D W: id -> (view, W, which expert: None for W^T, else W[e]'s e)
        self.views: dict[int, tuple[Tensor, Tensor, object]] = {}
        self.unfollowed, self.root = unfollowed, root
        self._hooked_init(copy)
        for t, spec in zip(tensors, entry, strict=True):
            if spec is not None:
                self.flow.keep(t, self.flow.lane(t, spec))
        super().__init__(plan, recipes, during, batch)
        # every selected parameter: any read but the recipes' fails the witness
        self.owned = plan.owned
        self.watched = set(self.owned)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.arange:  # positions, which a permutation's inverse may be made of
            out = func(*args, **kwargs)
            self.flow.iota(args, kwargs, out)
            return out
        if metadata(func):  # a third of the ops a routed call makes: no tensor looked at
            return func(*args, **kwargs)
        watched, views, rows, indices = self.watched, self.views, self.flow.rows, self.flow.indices
        read = followed = indexed = False
        for t in tensors_in(args, kwargs):  # a loop, not a generator: this runs on every op
            i = id(t)
            followed = followed or i in rows
            indexed = indexed or i in indices
            read = read or i in watched or (i in views and self._view(t) is not None)
        if not (read or followed or indexed):
            return func(*args, **kwargs)  # nothing followed, nothing watched
        name = op_name(func)
        out = self._watched(name, func, args, kwargs) if read else func(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            if followed:
                self.flow.follow(name, args, kwargs, out)
            if indexed:
                self.flow.indexing(name, args, kwargs, out)
        return out

    # -- reads of the watched parameters ----------------------------------------------------

    def _view(self, t: object) -> tuple | None:
        item = self.views.get(id(t))
        return item if item is not None and item[0] is t else None

    def _watched(self, name: str, func, args: tuple, kwargs: dict):
        if self._in_hooked(name, args, kwargs):
            return self._hooked(func, args, kwargs)
        w = args[0] if args else None
        if id(w) in self.watched and by_id(w, name, args, kwargs):  # Ergo's weight[expert_ids]
            return self._by_id(args)
        if id(w) in self.watched and (  # a view of a fused 3-D weight, or an expert's bias
            name in EXPERT_VIEWS if w.dim() == 3 else w.dim() == 2 and name == "__getitem__"
        ):  # picked from a 2-D one (``b[e]``)
            return self._viewed(name, func, args, kwargs)
        if name in ("grouped_mm", "_grouped_mm"):
            return self._grouped(func, args, kwargs)
        viewed = [v for t in tensors_in(args, kwargs) if (v := self._view(t)) is not None]
        if viewed:
            view = viewed[0]
            if name in CASTS and args[0] is view[0] and len(viewed) == 1:  # W[e].float()
                out = func(*args, **kwargs)
                self.views[id(out)] = (out, *view[1:])
                return out
            if name in EXPERT_READS and len(args) == 2 and not kwargs and view[0] is args[1]:
                return self._expert(name, func, args, view)
            if name in BIASED and len(args) == 2 and not kwargs and view[0].dim() == 1:
                return self._bias(name, func, args, view)
            return self._other(name, func(*args, **kwargs))
        if self.open:
            recipe = next((r for r in self.recipes if r.op == name and not r.expert), None)
            if recipe is None:
                return self._other(name, func(*args, **kwargs))
            broadcast = recipe.roles[0][0].startswith(ARG)  # x + b: b along x's rows
            read = self._broadcast if broadcast else self._read
            out = read(recipe, func, args, kwargs)
        else:
            done = self._next
            out = LightRegion.__torch_function__(self, func, (), args, kwargs)
            recipe = self.recipes[done] if self._next > done else None
        if recipe is not None:  # a recipe's read: its rows as the recipe lays them out
            self._lanes_hold(recipe, _input(recipe, name, args, kwargs))
        return out

    def _other(self, name: str, out: object) -> object:
        self.why = self.why or f"another read than the analysed batch's ({name})"
        return out

    def _viewed(self, name: str, func, args: tuple, kwargs: dict) -> object:
        """``W^T`` (W's last two dimensions swapped) or ``W[e]`` of a watched 3-D W."""
        w, out = args[0], func(*args, **kwargs)
        if name == "__getitem__":
            e = args[1]
            one = type(e) is int or (  # an expert's number, not a mask
                isinstance(e, Tensor) and e.dim() == 0 and not e.is_floating_point()
                and e.dtype != torch.bool
            )  # fmt: skip
            if one:
                self.views[id(out)] = (out, w, e)
                return out
            return self._other(name, out)
        d = [a % 3 for a in args[1:3]] if name != "mT" else [1, 2]
        if sorted(d) != [1, 2] or kwargs:
            return self._other(name, out)
        self.views[id(out)] = (out, w, None)
        return out

    def _lanes_hold(self, recipe: Recipe, x: Tensor) -> None:
        rows = self._rows_at(x)
        lanes = recipe.rows
        if rows is None:
            return
        if lanes is not None and lanes.dim != 0:
            self.why = self.why or "rows laid out along another dimension in a routed region"
            return
        m = 1 if lanes is None else lanes.m
        if not self.flow.settled(rows, (m, ())):
            self.flow.flag(rows != self.flow.lane(x, (0, m)))

    def _recipe(self, kind: tuple, x: Tensor) -> Recipe | None:
        """The recipe of a grouped or expert read of this kind: by kind in an open region,
        the next one in order (on an input of its shape) otherwise."""
        if self.open:
            return next((r for r in self.recipes if r.kind == kind), None)
        recipe = self.recipes[self._next] if self._next < len(self.recipes) else None
        if recipe is None or recipe.kind != kind or tuple(x.shape) != recipe.shape:
            return None
        self._next += 1
        if counter() - self._start != recipe.at:
            self.why = self.why or "other operations before a read than the analysed batch's"
        return recipe

    def _grouped(self, func, args: tuple, kwargs: dict) -> Tensor:
        x, weight = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        view = self._view(weight)
        if view is not None and view[2] is not None:
            return self._other("grouped_mm", func(*args, **kwargs))
        param, transposed = (view[1], False) if view is not None else (weight, True)
        p = self.owned.get(id(param))
        out = func(*args, **kwargs)
        extra = len(args) > 3 or any(v is not None for k, v in kwargs.items() if k != "offs")
        kind = ("grouped_mm", (("weight", p.name if p else ""),), transposed, False)
        if p is None or offs is None or extra or self._recipe(kind, x) is None:
            return self._other("grouped_mm", out)

        def routed(a: Tensor, grad: Tensor, rows: Tensor) -> dict:
            return {p.name: Routed.of(a, grad, rows, offs, param.shape, self.batch, transposed)}

        return self._serve((p,), x, weight, out, routed)

    def _expert(self, name: str, func, args: tuple, view: tuple) -> Tensor:
        """``F.linear(x, W[e])`` or ``x @ W[e]``: expert e's matrix on rows a value picked."""
        (x, weight), (_, param, e) = args, view
        p, out = self.owned.get(id(param)), func(*args)
        transposed = name != "linear"  # x @ W[e]: W is (E, in, out)
        kind = (name, (("weight", p.name if p else ""),), transposed, True)
        if p is None or (transposed and x.dim() != 2) or self._recipe(kind, x) is None:
            return self._other(name, out)

        def routed(a: Tensor, grad: Tensor, rows: Tensor) -> dict:
            expert = torch.as_tensor(e, device=a.device).expand(a.shape[0])
            return {p.name: Routed(a, grad, rows, expert, param.shape, self.batch, transposed)}

        return self._serve((p,), x, weight, out, routed)

    def _bias(self, name: str, func, args: tuple, view: tuple) -> Tensor:
        """``x + b[e]``: expert e's bias on rows a value picked (a Linear's on inputs of 1),
        read where the tap reads it: at its view broadcast to x's rows."""
        i = 0 if args[0] is view[0] else 1
        x, (bias, param, e) = args[1 - i], view
        p = self.owned.get(id(param))
        kind = (name, ((f"{ARG}{i}", p.name if p else ""),), False, True)
        if p is None or x.dim() != 2 or self._recipe(kind, x) is None:
            return self._other(name, func(*args))

        def routed(a: Tensor, grad: Tensor, rows: Tensor) -> dict:
            expert = torch.as_tensor(e, device=a.device).expand(a.shape[0])
            ones = a.new_ones(a.shape[0], 1)
            return {p.name: Routed(ones, grad, rows, expert, param.shape, self.batch, True)}

        spread = self._serve((p,), x, bias, broadcast_view(bias, x.shape), routed)
        return func(*((x, spread) if i else (spread, x)))

    def _serve(self, ps: tuple, x: Tensor, weight: Tensor, out: Tensor, routed: Callable) -> Tensor:
        """A read of ``ps`` on ``x``'s followed rows, its gradient at ``out`` to ``routed``."""
        rows = self._rows_at(x)
        if rows is None or not out.requires_grad:
            return out
        if self.flow.form(rows) is None:  # a form's rows are examples' (``forms.py``)
            self.flow.flag(rows < 0)
        a = x.detach()

        def parts(grad: Tensor) -> dict:
            return routed(a, grad, rows)

        target, viewed = read_at(out, [x, weight])
        with torch._C.DisableTorchFunction():
            use = Use(ps, edge(target), parts if viewed is None else viewed_parts(parts, viewed))
            self.hooks.add(target, use)
        self.uses.append(use)
        return out

    # -- the end ---------------------------------------------------------------------------

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        if self.open:  # reads as the batch makes them: no order, no count
            self.close()
            why = self.why or (None if len(outputs) == len(exit) else "other outputs")
        else:
            why = super().finish(outputs, exit)
        if why:
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
            elif not self.flow.settled(rows, (spec[1], ())):
                padded = rows != NO_ONE if self.root and tuple(spec) == (0, 1) else True
                self.flow.flag((rows != self.flow.lane(t, spec)) & padded)
        self.flow.rows.clear()
        return None

    def pending(self) -> Tensor | None:
        return self.flow.bad


def _input(recipe: Recipe, name: str, args: tuple, kwargs: dict) -> object:
    """The rows a recipe's read is on: a Linear's input; the other operand of ``x + b``."""
    role = recipe.roles[0][0]
    if role.startswith(ARG):
        return args[1 - int(role[len(ARG) :])] if len(args) == 2 else None
    call = bind_affine(name, args, kwargs)
    return None if call is None else call[0]
