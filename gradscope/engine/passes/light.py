"""Light regions: a region call (``analysis/regions.py``) whose only needs are reads of whole
parameters on rows laid out by shapes alone (one row per example, or ``Lanes``) that a
``Recipe`` serves (``recipes.py``): ``nn.MultiheadAttention``'s projections, read inside
``F.multi_head_attention_forward`` on sequence-first rows; a LayerScale's ``gamma`` broadcast
along the tokens. A replayed batch runs the call under ``LightRegion``, a torch function mode
that passes every op through but the reads of the watched parameters, which it serves by their
recipes: no trace, no owners, no tap. ``RootReads`` serves the same way the reads at the
model's top level, which no region call holds.

The witness of a light region call: its reads in the analysed order, each the same function on
an input of the same shape with the same parameters, after as many autograd nodes since the call
began as the analysed batch made; as many nodes over the whole call; as many outputs; no hooked
module called inside it. Any other call is ``Diverged`` and analysed in full.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..capture import Capture, ReadHooks, Use, counter, edge, read_at
from ..plan import Plan
from .recipes import (
    ARG,
    EXPAND,
    OPENED,
    Recipe,
    bind_affine,
    broadcast_parts,
    broadcast_view,
    metadata,
    name_of,
    viewed_parts,
)


class LightRegion(TorchFunctionMode):
    """One light region call of a replayed batch: ``recipes`` its reads, ``during`` the autograd
    nodes the analysed call made; entered at once, left by ``finish`` (or ``close``)."""

    def __init__(self, plan: Plan, recipes: Sequence[Recipe], during: int | None, batch: int):
        super().__init__()
        self.recipes, self.during, self.batch = tuple(recipes), during, batch
        self.params = {name: plan.find(name) for r in self.recipes for _, name in r.roles}
        self.watched = {id(p.param) for p in self.params.values()}
        self.session = Capture(())  # no hooked module inside: the replay's hooks find none
        self.uses: list[Use] = []
        self.hooks = ReadHooks()
        self.why: str | None = None
        self._next = 0
        self._start = counter()
        self._open = True
        self.__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = self.watched
        for a in args:  # loops, not a generator: this runs on every op
            if id(a) in watched:
                break
        else:
            for a in kwargs.values():
                if id(a) in watched:
                    break
            else:
                return func(*args, **kwargs)
        if metadata(func) or self._aside(args, kwargs):
            return func(*args, **kwargs)
        if func in OPENED:
            with self:  # its projections come to this mode one by one
                return OPENED[func](*args, **kwargs)
        recipe = self.recipes[self._next] if self._next < len(self.recipes) else None
        if recipe is not None and name_of(func) == recipe.op:
            self._next += 1
            if recipe.roles[0][0].startswith(ARG):
                return self._broadcast(recipe, func, args, kwargs)
            return self._read(recipe, func, args, kwargs)
        out = func(*args, **kwargs)
        if not (isinstance(out, Tensor) and id(out) in self.watched):  # W.to(its own dtype): W
            self.why = self.why or f"another read than the analysed batch's ({name_of(func)})"
        return out

    def _read(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        call = bind_affine(recipe.op, args, kwargs)
        if call is None or not self._matches(recipe, *call):
            self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.during is not None and counter() - self._start != recipe.at:
            self.why = self.why or "other operations before a read than the analysed batch's"
        x, weight, bias = call
        if isinstance(out, Tensor) and out.requires_grad:
            parts = recipe.parts(x, weight, bias, args, kwargs, self.batch)
            target, viewed = read_at(out, tree_flatten((args, kwargs))[0])
            if viewed is not None:
                parts = viewed_parts(parts, viewed)
            params = tuple(self.params[name] for _, name in recipe.roles)
            with torch._C.DisableTorchFunction():
                use = Use(params, edge(target), parts)
                self.hooks.add(target, use)
            self.uses.append(use)
        return out

    def _aside(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op on a watched parameter is not this region's to serve: none is."""
        return False

    def _broadcast(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A parameter broadcast along the result's rows, row r example r's: by an elementwise
        op, or ``p.expand(B, ...)`` (``analysis/broadcasts.py``)."""
        ((role, name),) = recipe.roles
        i, p = int(role[len(ARG) :]), self.params[name]
        expand = recipe.op in EXPAND
        if len(args) > i and args[i] is p.param:
            if expand:
                view = func(*args, **kwargs)
                shape = view.shape
            else:
                shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
                view = broadcast_view(p.param, shape) if tuple(shape) == recipe.shape else None
            at = recipe.at if self.during is None else counter() - self._start
            if view is not None and tuple(shape) == recipe.shape and at == recipe.at:
                per_row = broadcast_parts(p.param.shape, view.shape, self.batch)
                with torch._C.DisableTorchFunction():
                    use = Use((p,), edge(view), lambda grad: {name: per_row(grad)})
                    self.hooks.add(view, use)
                self.uses.append(use)
                return view if expand else func(*args[:i], view, *args[i + 1 :], **kwargs)
            if expand:
                self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
                return view
        self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
        return func(*args, **kwargs)

    def _matches(self, recipe: Recipe, x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
        roles = dict(recipe.roles)
        given = {"weight": weight, "bias": bias}
        return (
            isinstance(x, Tensor)
            and tuple(x.shape) == recipe.shape
            and all(given.get(role) is self.params[name].param for role, name in roles.items())
            and all(t is None or id(t) not in self.watched or r in roles for r, t in given.items())
        )

    # -- as the replay and the backward ask a region ----------------------------------------

    def enter(self, module: nn.Module, args: tuple) -> None:
        """A hooked module's call inside the region, which the analysed batch's made none of."""
        self.why = self.why or f"other operations than the analysed batch's (a {_kind(module)})"

    def captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        pass

    def close(self) -> None:
        if self._open:
            self._open = False
            self.__exit__(None, None, None)

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        """The call's end: why the batch is not one the analysis describes, or None."""
        self.close()
        if self.why:
            return self.why
        if self._next != len(self.recipes):
            return "fewer reads than the analysed batch's"
        if len(outputs) != len(exit) or counter() - self._start != self.during:
            return "other operations than the analysed batch's"
        return None

    def calls(self) -> list:
        return []

    def pending(self) -> Tensor | None:
        """What the replay must read on the host at the forward's end: none here."""
        return None

    def reads(self) -> list[Use]:
        return list(self.uses)

    def reading(self, on_grad: Callable | None) -> None:
        self.hooks.reading(on_grad)


class RootReads(LightRegion):
    """The reads of a replayed batch outside every region call and every call of their
    parameters' modules (a ViT's ``cls_token`` and ``pos_embed`` at the model's top level),
    served by their recipes as a light region serves its own, in the analysed order, over the
    whole forward; ``ruled(p)``: whether a call of the module whose rule serves ``p`` is under
    way (its reads there are the rule's). The replay's witness between its events stands for
    the autograd nodes before each read."""

    def __init__(self, plan: Plan, recipes: Sequence[Recipe], batch: int, ruled: Callable):
        self.ruled = ruled
        super().__init__(plan, recipes, None, batch)

    def _aside(self, args: tuple, kwargs: dict) -> bool:
        """Whether the op reads a parameter inside a call of the module whose rule serves it."""
        found = {id(a) for a in (*args, *kwargs.values())}
        return any(self.ruled(p) for p in self.params.values() if id(p.param) in found)

    def finish_reads(self) -> str | None:
        """The forward's end: why the batch's reads are not the analysed ones, or None."""
        self.close()
        if self.why:
            return self.why
        return "fewer reads than the analysed batch's" if self._next != len(self.recipes) else None


def in_order(reads: list[Use]) -> list[Use]:
    """Reads in the order the forward made them (their gradients' nodes were made then)."""
    return sorted(reads, key=lambda u: u.edge.node._sequence_nr())


def _kind(module: nn.Module) -> str:
    return type(module).__name__
