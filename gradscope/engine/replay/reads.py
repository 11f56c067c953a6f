"""How a light region (``light.py``) serves each read by its recipe (``recipes.py``): a
linear, embedding or product read, a convolution, a broadcast along the rows; each role's
tensor a parameter itself or a tensor made from the recipe's parameters at that role, whose
part goes back to them (``derived.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..capture import Use, counter, edge, read_at
from ..derived import Computed, Derived
from ..ops import SPREAD
from ..parts import (
    bind_affine,
    bind_conv,
    broadcast_parts,
    broadcast_view,
    conv_parts,
    einsum_operands,
    einsum_part,
    einsum_read,
    element_parts,
    lane_experts,
    lane_rows,
    left_part,
    product_part,
    read_parts,
    viewed_parts,
)
from ..recipes import ARG, Recipe
from ..tensors import tensors_in


class RecipeReads:
    """A light region's reads (``LightRegion`` is one): uses its ``params``, ``made``,
    ``watched``, ``batch``, ``during``, ``hooks``, ``uses`` and ``why``."""

    def _read(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A linear, embedding or product read of the recipe's parameters (or of tensors made
        from them)."""
        if recipe.slot is not None or recipe.equation is not None:
            return self._product(recipe, func, args, kwargs)
        if recipe.op == "bmm":
            return self._bmm(recipe, func, args, kwargs)
        call = bind_affine(recipe.op, args, kwargs)
        if recipe.left:  # W @ x
            call = (args[1], args[0], None) if len(args) == 2 and not kwargs else None
        if recipe.expand and call is not None and args and args[0] is call[0]:
            one = call[0].unsqueeze(0) if call[0].dim() == 1 else call[0]
            args = (one.expand(self.batch, *one.shape[1:]), *args[1:])  # as the analysis did
            call = (args[0], *call[1:])
        sources = None if call is None else self._sources(recipe, call[0], call[1:])
        out = self._run(recipe, sources, func, args, kwargs)
        if sources is not None and isinstance(out, Tensor) and out.requires_grad:
            x, weight, bias = call
            a = x.detach()
            if recipe.left:

                def by_role(grad: Tensor) -> dict:
                    return {"weight": left_part(a, grad, weight)}

            else:
                by_role = read_parts(
                    recipe.op, a, weight, bias, recipe.rows, args, kwargs, self.batch
                )
            target, viewed = read_at(out, tensors_in(args, kwargs))
            self._credited(
                sources, target, by_role if viewed is None else viewed_parts(by_role, viewed)
            )
        return out

    def _product(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A product whose leading dimensions broadcast, or an einsum, of the recipe's tensor
        and a batch x: each product's gradient summed into its example by the analysed slots
        or rows, laid out by shapes alone (``parts.product_part``, ``parts.einsum_part``)."""
        pair = None  # (x, W)
        if recipe.equation is not None:
            read = einsum_read(args[0], einsum_operands(args, kwargs), self._source)
            if read is not None and recipe.equation in read[2]:
                pair = read[:2]
        elif len(args) == 2 and not kwargs:
            pair = (args[1], args[0]) if recipe.left else (args[0], args[1])
        sources = None if pair is None else self._sources(recipe, pair[0], (pair[1], None))
        out = self._run(recipe, sources, func, args, kwargs)
        if sources is not None and isinstance(out, Tensor) and out.requires_grad:
            x, weight = pair
            if recipe.equation is not None:
                part = einsum_part(recipe.equation, x.detach(), recipe.slot, self.batch)
            else:
                part = product_part(x.detach(), weight.shape, recipe.left, recipe.slot, self.batch)
            target, viewed = read_at(out, tensors_in(args, kwargs))

            def parts(grad: Tensor) -> dict:
                return {"weight": part(grad)}

            self._credited(
                sources, target, parts if viewed is None else viewed_parts(parts, viewed)
            )
        return out

    def _bmm(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """``bmm(x, W)`` of (E, N, in) rows laid out by the recipe's lanes along N and a fused
        (E, in, out) W: expert e's Linear on x[e] (``parts.lane_experts``)."""
        x, weight = args if len(args) == 2 and not kwargs else (None, None)
        sources = self._sources(recipe, x, (weight, None))
        out = self._run(recipe, sources, func, args, kwargs)
        if sources is not None and isinstance(out, Tensor) and out.requires_grad:
            a, m, batch = x.detach(), recipe.rows.m, self.batch
            self._credited(sources, out, lambda g: {"weight": lane_experts(a, g, m, batch)})
        return out

    def _conv(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A convolution of the recipe's weight and bias (or of tensors made from them)."""
        x, weight, bias, call = bind_conv(recipe.op, args, kwargs)
        sources = self._sources(recipe, x, (weight, bias))
        out = self._run(recipe, sources, func, args, kwargs)
        if sources is not None and isinstance(out, Tensor) and out.requires_grad:
            a, biased = x.detach(), "bias" in sources
            self._credited(sources, out, lambda g: conv_parts(call, a, g, biased))
        return out

    def _run(self, recipe: Recipe, sources: dict | None, func, args: tuple, kwargs: dict):
        """The read's op: the witness fails where its roles' sources are not found, or where
        other autograd nodes than the analysed came before it."""
        out = func(*args, **kwargs)
        if sources is None:
            self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
        elif self.during is not None and counter() - self._start != recipe.at:
            self.why = self.why or "other operations before a read than the analysed batch's"
        return out

    def _sources(self, recipe: Recipe, x: object, given: tuple) -> dict | None:
        """What each role of an affine read or a convolution takes (``_source_of``), where its
        input has the recipe's shape and no other watched tensor takes part; else None."""
        if not isinstance(x, Tensor) or tuple(x.shape) != recipe.shape:
            return None
        given = dict(zip(("weight", "bias"), given, strict=True))
        sources = {r: self._source_of(recipe, given.get(r), r) for r, _ in recipe.roles}
        if any(s is None for s in sources.values()):
            return None
        others = [t for r, t in given.items() if r not in sources and t is not None]
        return None if any(id(t) in self.watched for t in others) else sources

    def _credited(self, sources: dict, out: Tensor, parts: Callable) -> None:
        """``out``'s gradient to ``parts`` (role -> its contribution), each role's then to the
        parameters its ``sources`` entry is made from. None where ``out`` was made under
        ``no_grad``, as a program that no rule serves is replayed (every parameter on the
        fallback): no gradient arrives there, and a view has no edge to wait at."""
        if out.grad_fn is None:
            return

        def credit(grad: Tensor) -> dict:
            got: dict = {}
            for role, part in parts(grad).items():
                if role in sources:
                    for name, c in sources[role].credit(part).items():
                        got[name] = got[name].merge(c) if name in got else c
            return got

        params = tuple({id(p): p for s in sources.values() for p in s.params}.values())
        with torch._C.DisableTorchFunction():
            use = Use(params, edge(out), credit)
            self.hooks.add(out, use)
        self.uses.append(use)

    def _broadcast(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A parameter, or a tensor made from parameters, broadcast along the result's rows,
        row r example r's: by an elementwise op, or ``p.expand(B, ...)``
        (``analysis/broadcasts.py``)."""
        role = recipe.roles[0][0]
        i = int(role[len(ARG) :])
        source = self._source_of(recipe, args[i] if len(args) > i else None, role)
        expand = recipe.op in SPREAD
        if source is not None:
            if expand:
                view = func(*args, **kwargs)
                shape = view.shape
            else:
                shape = _broadcast_shape([a.shape for a in args if isinstance(a, Tensor)])
                view = None
                if shape is not None and tuple(shape) == recipe.shape:
                    view = _elements_view(args[i], shape) if recipe.elements else None
                    view = broadcast_view(args[i], shape) if view is None else view
            at = recipe.at if self.during is None else counter() - self._start
            if view is not None and tuple(shape) == recipe.shape and at == recipe.at:
                per_row = self._per_row(recipe, args[i], view)
                self._credited({role: source}, view, lambda g: {role: per_row(g)})
                return view if expand else func(*args[:i], view, *args[i + 1 :], **kwargs)
            if expand:
                self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
                return view
        self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
        return func(*args, **kwargs)

    def _per_row(self, recipe: Recipe, source: Tensor, view: Tensor) -> Callable:
        """A broadcast read's per-example parts: by rows (one example's each, or lanes), or
        element by element, as the analysed batch's owners laid them out."""
        if recipe.elements is not None:
            return element_parts(*recipe.elements, self.batch, source.shape)
        rows = recipe.rows and lane_rows(recipe.rows, view.shape[0], self.batch, view.device)
        return broadcast_parts(source.shape, view.shape, self.batch, rows)

    def _source_of(self, recipe: Recipe, t: object, role: str) -> Derived | Computed | None:
        """What ``role`` of a read takes: the recipe's parameter itself, or a tensor made from
        the recipe's parameters at that role alone; None for any other."""
        names = recipe.names(role)
        if role in recipe.computed:
            made = self.made.get(id(t))
            if made is None or tuple(p.name for p in made[1].params) != names:
                return None
            if isinstance(made[1], Computed) and not made[1].pure:
                return None  # made from something the batch may own
            return made[1]
        p = self.params[names[0]]
        return Derived(p) if t is p.param else None


def _broadcast_shape(shapes: list[torch.Size]) -> torch.Size | None:
    """The shape ``shapes`` broadcast to, None where they do not (``torch.broadcast_shapes``,
    without its symbolic-shape guards: a tenth of the cost, on every broadcast read)."""
    out = [1] * max(len(s) for s in shapes)
    for shape in shapes:
        for k, n in enumerate(shape, len(out) - len(shape)):
            if n != out[k] and 1 not in (n, out[k]):
                return None
            out[k] = n if out[k] == 1 else out[k]
    return torch.Size(out)


def _elements_view(source: Tensor, shape: torch.Size) -> Tensor:
    """``source`` aligned to a result of ``shape`` and expanded to all of it: each element's
    gradient its own."""
    return source.reshape((1,) * (len(shape) - source.dim()) + tuple(source.shape)).expand(shape)
