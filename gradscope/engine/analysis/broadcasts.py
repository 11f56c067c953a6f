"""The tap's reads by broadcasting: a parameter (or a view of one) taken by an elementwise op
whose result has the batch's rows, ``p.expand(B, ...)``, and a write ``x[index] = p``. Each
example's gradient sums the gradient at the elements it owns."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...rules.base import CHUNK_ELEMENTS
from ..derived import Watched
from ..ops import BROADCASTING, EXPAND
from ..parts import broadcast_parts, broadcast_view, element_parts, owned
from ..recipes import ARG, Recipe, recipe_roles
from ..rows import Lanes
from .experts import expert_bias
from .owners import combine, is_batch, lane_of, reduce, slots

WRITTEN = object()  # what a served write (``x[i] = p``, which returns nothing) gives back


class BroadcastReads:
    """The tap's reads by broadcasting (``ParamTap`` is one): uses its batch, trace,
    ``_watched``, ``_batch_free``, ``_other`` and ``_use``."""

    def _broadcast(self, name: str, i: int, d: Watched, func, args, kwargs) -> Tensor | None:
        """The op's result with the parameter read through a batch view, or None."""
        source = args[i]
        if (name in EXPAND or name == "repeat" and _repeats_rows(args)) and i == 0:
            with torch.no_grad():  # its shape: an op run here that no replay would make
                shape = func(*args, **kwargs).shape
            if not self._batched(source, shape):
                return None
            out = func(*args, **kwargs)  # p.expand(B, ...), p.repeat(B, 1, ...)
            return self._view(d, source, out, recipe=_recipe(name, i, d, source, out.shape))
        if name not in BROADCASTING or (name.endswith("_") and i == 0):
            return None
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
        if self._batch_free(args, kwargs):
            return None  # the parameters and what no example owns: followed as computed
        rows = self._row_examples(args, shape) if _spread(source, shape) else False
        if rows is not False:
            # (0, m): Swin's windows; with one example, every row its own (sequence-first)
            lane = (
                None if rows is None else (0, 1) if self.batch == 1 else lane_of(rows, self.batch)
            )
            recipe = None
            if rows is None or lane is not None:
                lanes = None if lane is None else Lanes(lane[0], lane[1], 1)
                recipe = _recipe(name, i, d, source, shape, lanes)
            else:  # rows the batch's values picked: an expert's bias, a routed region's
                recipe = expert_bias(name, i, d, args, shape)
            view = self._view(d, source, broadcast_view(source, shape), rows, recipe)
        else:
            owners = combine(*(self.trace.owner(a) for a in args if isinstance(a, Tensor)))
            view = self._elements(d, source, shape, owners, (name, i))
            if view is None:
                self._other(d, f"{name} on rows not the examples")
                return None
        return func(*args[:i], view, *args[i + 1 :], **kwargs)

    def _elements(
        self,
        d: Watched,
        source: Tensor,
        shape: torch.Size,
        owners: Tensor,
        op: tuple[str, int] | None = None,
    ) -> Tensor | None:
        """``source`` broadcast to ``shape``, each element of which is read by the example that
        owns that element of the result (``owners``): example b's gradient of ``source`` sums
        the gradient at b's elements, each at the element of ``source`` it broadcasts from (one
        ``index_add`` for the batch). This serves a bias on tokens laid out along any dimension
        (sequence-first, heads first), a tensor computed with the batch's shape from no example
        (an attention mask's bias), and a CLIP-like (B, B) similarity scaled by
        ``logit_scale.exp()``, each example's loss reading its own diagonal element. Elements
        of several examples or of none must get no gradient: one that does fails the read, and
        its parameters go to the fallback (the losses would mix). None where the positions or
        the per-example gradients would pass ``CHUNK_ELEMENTS``."""
        if max(shape.numel(), self.batch * source.numel()) > CHUNK_ELEMENTS:
            return None
        view = source.reshape((1,) * (len(shape) - source.dim()) + tuple(source.shape))
        view = view.expand(shape)
        mine = (owners.expand(shape) >= 0).reshape(-1)
        slot = slots(owners, shape, source.shape)[mine]  # (example, element of source)
        elements = owned(mine, slot)
        per_element = element_parts(*elements, self.batch, source.shape)
        recipe = None if op is None else _recipe(*op, d, source, shape)  # ``op``: (name, i)
        if recipe is not None:  # its owners are laid out by shapes: a light region's again
            recipe = dataclasses.replace(recipe, elements=elements)
        self._use(d.params, view, lambda grad: d.credit(per_element(grad)), recipe)
        return view

    def _write(self, d: Watched, func, args: tuple) -> object:
        """``x[index] = p``: the elements written read ``p`` broadcast to them, each by the
        example that owned it in ``x`` (T5Gemma 2's end-of-image embedding written where the
        ids say); they belong to that example from here on."""
        x, index, value = args
        if self._watched(x) is not None or self._batch_free((x,), {}):
            return None
        owners = self.trace.owner(x).expand(x.shape)[index]
        if value.dim() > owners.dim():
            return None
        view = self._elements(d, value, owners.shape, owners)
        if view is None:
            return None
        self.trace.owners[view] = owners
        func(x, index, view)
        return WRITTEN

    def _batched(self, source: Tensor, shape: torch.Size) -> bool:
        """Whether a result of ``shape`` has the batch on dimension 0 and takes ``source``
        broadcast along it."""
        return len(shape) > 0 and shape[0] == self.batch and _spread(source, shape)

    def _row_examples(self, args: tuple, shape: torch.Size) -> Tensor | None | bool:
        """The example of each row of the op's result, by the other operands' owners: None
        when row i is example i's, (rows,) when each is one example's (Swin's windows, folded
        into the batch), False when a row mixes examples or is no example's."""
        owners = [self.trace.owner(a) for a in args if isinstance(a, Tensor)]
        o = reduce(combine(*owners), range(1, len(shape)))
        if o.dim() != len(shape):
            return False
        if shape[0] == self.batch and is_batch(o, self.batch):
            return None
        rows = o.reshape(-1).expand(shape[0])
        return rows.contiguous() if bool((rows >= 0).all()) else False

    def _view(
        self,
        d: Watched,
        source: Tensor,
        view: Tensor,
        rows: Tensor | None = None,
        recipe: Recipe | None = None,
    ):
        """``view``, row r of which is read by example r (or ``rows[r]``), served; ``recipe``:
        how a light region serves it again."""
        per_row = broadcast_parts(source.shape, view.shape, self.batch, rows)
        self._use(d.params, view, lambda grad: d.credit(per_row(grad)), recipe)
        # the trace follows where each row goes from here
        owner = self.trace.standard(view.dim())
        if rows is not None:
            owner = rows.view(-1, *(1,) * (view.dim() - 1))
        self.trace.owners[view] = owner
        return view


def _recipe(
    name: str, i: int, d: Watched, source: Tensor, shape, lanes: Lanes | None = None
) -> Recipe | None:
    """A broadcast along rows one example's each (row r example r's, or ``lanes``) of a whole
    parameter, a view of one, or a tensor made from parameters and constants alone
    (``Computed.pure``): a light region's."""
    roles = recipe_roles([(f"{ARG}{i}", d)], {f"{ARG}{i}": source})
    if roles is None:
        return None
    return Recipe(name, roles[0], tuple(shape), lanes, computed=roles[1], constants=roles[2])


def _spread(source: Tensor, shape: torch.Size) -> bool:
    """Whether a result of ``shape`` takes ``source`` broadcast along its dimension 0."""
    if len(shape) == 0 or source.dim() > len(shape):
        return False
    return source.dim() < len(shape) or source.shape[0] == 1


def _repeats_rows(args: tuple) -> bool:
    """Whether ``t.repeat(*sizes)`` only repeats along dimension 0 (``probe.repeat(B, 1, 1)``)."""
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    return len(sizes) > 0 and all(n == 1 for n in sizes[1:])
