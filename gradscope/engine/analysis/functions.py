"""The functions a layer rule's math serves where the tap sees them called on a watched
parameter (or a view of one, or a tensor computed from parameters): ``F.linear``, ``x @ W`` and
``W @ x``, ``F.embedding``, ``F.conv{1,2,3}d``, ``einsum`` (fused expert weights run by
``grouped_mm`` or ``bmm``: ``experts.py``); each on rows traced to their examples
(``trace.py``), gathered where they are in another layout, placed where the view sits in its
parameter."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from ...rules import Contribution
from ..capture import read_at
from ..parts import (
    bind_affine,
    bind_conv,
    conv_parts,
    einsum_operands,
    einsum_part,
    einsum_read,
    left_part,
    product_part,
    read_parts,
    viewed_parts,
)
from ..recipes import Recipe, recipe_roles
from ..rows import Lanes
from .experts import expert_recipe
from .owners import NONE, is_batch, reduce, rows_of, rows_or_none, slots
from .policy import ASSUMED, assumable, shared


class FunctionReads:
    """The tap's reads by functions (``ParamTap`` is one): uses its batch, trace, ``expand`` and
    ``assume`` settings, ``_watched``, ``_batch_free``, ``_other`` and ``_use``."""

    def _function(self, name: str, func, args: tuple, kwargs: dict) -> Tensor | None:
        call = bind_affine(name, args, kwargs)
        if call is None:
            return None
        x, weight, bias = call
        reads = [(role, self._watched(t)) for role, t in (("weight", weight), ("bias", bias))]
        reads = [(role, d) for role, d in reads if d is not None]
        if not reads or self._watched(x) is not None:
            return None
        expanded = self.expand and shared(self.trace, x)
        assumed = self.assume and x.dim() and x.shape[0] == self.batch
        if self._batch_free((x,), {}) and not expanded and not assumed:
            return None  # computed from the parameters alone: followed as such
        features = 0 if name == "embedding" else 1
        if expanded and name in ("linear", "embedding"):
            one = x.unsqueeze(0) if x.dim() == 1 else x
            x = one.expand(self.batch, *one.shape[1:])
            args = (x, *args[1:])
            self.expanded = True
        rows = self._rows(x, features)
        if rows is False:
            for _, d in reads:
                self._other(d, f"{name} on rows that mix examples")
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        assumed_rows = rows is ASSUMED
        if assumed_rows:
            rows = None
            self.trace.owners[out] = self.trace.standard(out.dim())
        if not out.requires_grad:
            return out
        rows = None if rows is None else rows_of(rows, self.batch)
        by_role = read_parts(name, x.detach(), weight, bias, rows, args, kwargs, self.batch)

        def parts(grad: Tensor) -> dict[str, Contribution]:
            got = by_role(grad)
            return _credit((d, got[role]) for role, d in reads if role in got)

        recipe = None  # a read laid out by shapes alone: a light region's
        spread = expanded and name in ("linear", "embedding")  # its shared rows expanded: the
        # examples' rows, as assumed (row i example i's) where some or all are of no example (a
        # decoder's start token before each example's ids; positions looked up by an arange
        # expanded to the batch), by that
        if spread or not expanded:
            recipe = expert_recipe(name, reads, x) if not (spread or assumed_rows) else None
            roles = recipe_roles(reads, {"weight": weight, "bias": bias})
            if recipe is None and roles and (rows is None or isinstance(rows, Lanes)):
                shape = tuple(x.shape)
                recipe = Recipe(
                    name, roles[0], shape, rows, computed=roles[1], constants=roles[2],
                    expand=spread, assumed=assumed_rows,
                )  # fmt: skip
        self._read_output(tuple(p for _, d in reads for p in d.params), out, parts, args, recipe)
        return out

    def _product(self, name: str, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``W @ x`` for a batch ``x`` of (B, in, L): ``F.linear(x.mT, W).mT``, by its math
        (Mamba's ``dt_proj``); otherwise ``W @ x`` or ``x @ W`` with leading dimensions that
        broadcast (Zamba's per-head ``W[:, None] @ x``, a relative-position table projected
        once for the batch and multiplied by each example's queries): the gradient of each
        product, ``grad @ x.mT`` or ``x.mT @ grad``, summed into the example that owns its x."""
        if name == "__rmatmul__" or len(args) != 2 or kwargs:
            return None
        left = self._watched(args[0]) is not None
        weight, x = args if left else args[::-1]
        d = self._watched(weight)
        if d is None or weight.dim() < 2 or x.dim() < 3 or self._watched(x) is not None:
            return None
        a, slot = x.detach(), None
        if left and weight.dim() == 2 and self._examples_lead(x):

            def parts(grad: Tensor) -> dict[str, Contribution]:
                return d.credit(left_part(a, grad, weight))

        else:
            lead, ws = torch.broadcast_shapes(weight.shape[:-2], x.shape[:-2]), weight.shape[:-2]
            o = reduce(self.trace.owner(x), [-2, -1], keepdim=False)
            if not bool((o >= 0).all()):
                return None
            slot = slots(o, lead, ws)  # (example, matrix of W) of each product
            part = product_part(a, weight.shape, left, slot, self.batch)

            def parts(grad: Tensor) -> dict[str, Contribution]:
                return d.credit(part(grad))

        out = func(*args)
        if out.requires_grad:
            roles = recipe_roles([("weight", d)], {"weight": weight})
            recipe = None  # the slots, laid out by shapes in a light region
            if roles is not None:
                shape = tuple(x.shape)
                recipe = Recipe(
                    name, roles[0], shape, None, computed=roles[1], constants=roles[2],
                    left=left, slot=slot,
                )  # fmt: skip
            self._read_output(d.params, out, parts, args, recipe)
        return out

    def _conv(self, name: str, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``F.conv{n}d`` on a watched weight (a weight-norm one) or bias, by the conv rule."""
        x, weight, bias, call = bind_conv(name, args, kwargs)
        reads = [(role, self._watched(t)) for role, t in (("weight", weight), ("bias", bias))]
        reads = [(role, d) for role, d in reads if d is not None]
        if not reads or self._watched(x) is not None or x.dim() != len(call.kernel_size) + 2:
            return None
        if not self._examples_lead(x):
            return None
        out = func(*args, **kwargs)
        if not out.requires_grad:
            return out
        a = x.detach()

        def parts(grad: Tensor) -> dict[str, Contribution]:
            got = conv_parts(call, a, grad, bias is not None)
            return _credit((d, got[role]) for role, d in reads if role in got)

        recipe = _conv_recipe(name, reads, {"weight": weight, "bias": bias}, x)
        self._read_output(tuple(p for _, d in reads for p in d.params), out, parts, args, recipe)
        return out

    def _einsum(self, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``einsum(eq, x, W)`` (either order) with an index of the batch ``x`` the batch's,
        also the output's and not W's, at any position (XLNet's sequence-first
        ``einsum("ibh,hnd->ibnd", h, q)``): example b's gradient of W is ``einsum(x, grad)``
        at b's rows summed over every other index but W's (and over b's rows, where heads are
        folded into the batch), one einsum for the batch (SAM's and Funnel's relative
        attention); B rows of no example along it (XLNet's position table expanded to the
        batch) as the rows policy's assumed rows."""
        read = einsum_read(args[0], einsum_operands(args, kwargs), self._watched)
        found = None if read is None else self._einsum_rows(read[0], read[2])
        if found is None:
            return None
        (x, weight, _), (per_row, rows) = read, found
        d = self._watched(weight)
        out = func(*args)
        assumed = rows is ASSUMED
        if assumed:
            rows, self.assumed = None, True
            terms, index = per_row.split("->")
            dim = terms.split(",")[1].index(index[0])  # the batch's in the output
            self.trace.owners[out] = self.trace.lane_owners(out.dim(), (dim, 1), self.batch)
        if not out.requires_grad:
            return out
        part = einsum_part(per_row, x.detach(), rows, self.batch)

        def parts(grad: Tensor) -> dict[str, Contribution]:
            return d.credit(part(grad))

        roles = recipe_roles([("weight", d)], {"weight": weight})
        recipe = None  # each row's example, laid out by shapes in a light region
        if roles is not None:
            recipe = Recipe(
                "einsum", roles[0], tuple(x.shape), None, computed=roles[1],
                constants=roles[2], slot=rows, equation=per_row, assumed=assumed,
            )  # fmt: skip
        self._read_output(d.params, out, parts, args, recipe)
        return out

    def _einsum_rows(self, x: Tensor, per_row: tuple) -> tuple | None:
        """(the per-row equation, ``_lead_rows`` of its batch dimension) of the first dimension
        of ``x`` whose rows are one example's each, row r example r's first; else of one
        whose B rows are of their example or of none, ASSUMED (the rows policy's, as for
        ``F.linear``); else None."""
        found = [(e, self._lead_rows(x, k)) for k, e in enumerate(per_row) if e is not None]
        for e, rows in sorted(found, key=lambda f: f[1] is not None):
            if rows is not False:
                return e, rows
        for k, e in enumerate(per_row):
            if e is not None and self.assume and x.shape[k] == self.batch and x.numel():
                o = self._owners_along(x, k)
                if bool((o == NONE).any()) and rows_or_none(o, self.batch):
                    return e, ASSUMED
        return None

    def _read_output(self, params: tuple, out: Tensor, parts, args: tuple, recipe=None) -> None:
        """``_use`` on a function's output, read where ``graph.read_at`` says."""
        target, viewed = read_at(out, tree_flatten(args)[0])
        self._use(params, target, parts if viewed is None else viewed_parts(parts, viewed), recipe)

    def _examples_lead(self, x: Tensor) -> bool:
        """Whether ``x[i]`` is example i's alone (B along dimension 0, nothing else mixed in)."""
        return self._lead_rows(x) is None

    def _lead_rows(self, x: Tensor, dim: int = 0) -> Tensor | None | bool:
        """Whose ``x[r]`` (along ``dim``) is, whole: None for example r's, (R,) examples where
        each ``x[r]`` is one example's (heads folded into the batch: SAM's (B*heads, ...)),
        False otherwise."""
        if x.dim() == 0 or x.numel() == 0:
            return False
        o = self.trace.owner(x)
        if dim == 0 and x.shape[0] == self.batch and self.trace.one_row_each(x, o, x.dim() - 1):
            return None
        rows = self._owners_along(x, dim)
        if x.shape[dim] == self.batch and is_batch(rows, self.batch):
            return None
        rows = rows.reshape(-1).expand(x.shape[dim])
        return rows.contiguous() if bool((rows >= 0).all()) else False

    def _owners_along(self, x: Tensor, dim: int) -> Tensor:
        """``x``'s owners reduced over every dimension but ``dim``, moved to dimension 0."""
        others = [k for k in range(x.dim()) if k != dim]
        return reduce(self.trace.owner(x), others).movedim(dim, 0)

    def _rows(self, x: Tensor, features: int) -> Tensor | None | bool | object:
        """None: one row per example on dimension 0; a tensor: each row's example, for the rows
        to be gathered; ASSUMED: B rows computed (wholly or in part) from no example, taken as
        the examples' (the rows policy's); False: rows that mix examples or that the batch
        shares."""
        if x.dim() <= features:
            return False
        if self.trace.one_row_each(x, self.trace.owner(x), features):
            return None
        o = reduce(self.trace.owner(x), range(x.dim() - features, x.dim()), keepdim=False)
        o = o.expand(x.shape[: x.dim() - features])  # owners may be compact (one example)
        if x.numel() == 0:
            return torch.zeros(x.shape[: x.dim() - features], dtype=torch.long, device=x.device)
        if is_batch(o.reshape(o.shape[0], -1), self.batch):
            return None
        if bool((o >= 0).all()):
            return o
        if self.assume and assumable(self.trace, x, o):
            self.assumed = True
            return ASSUMED
        return False


def _credit(reads) -> dict[str, Contribution]:
    """Each parameter's contribution from the (watched tensor, its part) of one call's reads."""
    out: dict[str, Contribution] = {}
    for d, part in reads:
        for name, c in d.credit(part).items():
            out[name] = out[name].merge(c) if name in out else c
    return out


def _conv_recipe(name: str, reads: list, given: dict, x: Tensor) -> Recipe | None:
    """A convolution's read of its weight and bias, each a parameter or a tensor made from
    parameters and constants (a weight-norm weight), on one row per example: a light
    region's."""
    roles = recipe_roles(reads, given)
    return (
        None
        if roles is None
        else Recipe(name, roles[0], tuple(x.shape), None, computed=roles[1], constants=roles[2])
    )
