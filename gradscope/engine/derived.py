"""What the tap follows of the watched parameters, and how a read's gradient goes back to them.

- ``Derived``: a view of one parameter at a known ``Place`` (``W[e]``, ``W.T``, ``1 + w``): a
  read's per-example gradient is placed where the view sits, in whatever form the rule gave it.
- ``Computed``: a tensor that ops computed from watched tensors and tensors no example owns
  (``-exp(A_log)``, a weight-norm weight, a position table indexed by ``arange``, attention
  sinks reshaped). Every example reads the same value, so example i's gradient of the sources is
  the vector-Jacobian product of those ops with example i's gradient of the tensor: formed and
  carried back by one batched VJP, then placed as above; a few examples at a time where the
  batch's gradients of the tensor and of its sources would pass ``CHUNK_ELEMENTS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rules import Contribution, Dense, base
from ..rules.formed import Formed
from ..rules.placed import Place, Placed
from . import vjps
from .backs import back_of
from .constants import Constants
from .ops import op_name
from .plan import ParamPlan
from .pulled import Pulled
from .tensors import flatten


@dataclass(frozen=True)
class Derived:
    """A tensor read from a watched parameter, at ``place``."""

    param: ParamPlan
    place: Place = Place()

    @property
    def params(self) -> tuple[ParamPlan, ...]:
        return (self.param,)

    def credit(self, part: Contribution) -> dict[str, Contribution]:
        """``part``, the per-example gradient of this view, where it sits in the parameter."""
        if self.place == Place():
            return {self.param.name: part}
        return {self.param.name: Placed(part, self.param.param.shape, self.place)}


@dataclass(frozen=True, eq=False)
class Computed:
    """``func(*values)``: computed from the views ``leaves`` (whose tensors are ``values``) and
    from tensors no example owns, which ``func`` holds."""

    func: Callable[..., Tensor]
    leaves: tuple[Derived, ...]
    values: tuple[Tensor, ...]  # detached
    batch: int
    # made from parameters and ``Constants`` alone: a light region (which has no trace to
    # tell what else is no example's) may compute it again (``replay/light.py``)
    pure: bool = False
    # made from parameters and numbers alone, no other tensor (no buffer, no ``arange``): a
    # region that sees only the ops on parameters (``replay/intercept.py``) tells it too
    alone: bool = False
    # what makes it (ops, arguments' shapes, leaves): the tensors of one kind go back one way
    kind: tuple = ()
    # (B, *its shape) gradients -> (B, *leaf shape) per leaf, written out (``backs.py``)
    back: Callable[[Tensor], tuple[Tensor, ...]] | None = None
    # a ``torch.cat`` of whole parameters alone: its dimension and each one's size along it
    pieces: tuple[int, tuple[int, ...]] | None = None

    @property
    def params(self) -> tuple[ParamPlan, ...]:
        return tuple({id(d.param): d.param for d in self.leaves}.values())

    def credit(self, part: Contribution) -> dict[str, Contribution]:
        """Each parameter's per-example gradient from ``part``, this tensor's: formed for the
        batch at once (one whole parameter's when asked for, the reads of it merged first:
        ``Pulled``), or where that passes ``CHUNK_ELEMENTS`` (a weight-norm convolution's
        weight, B times) formed again for each question a few examples at a time."""
        per_example = part.shape.numel() + sum(v.numel() for v in self.values)
        step = max(1, base.CHUNK_ELEMENTS // per_example)
        if step >= self.batch and len(self.leaves) == 1 and self.leaves[0].place == Place():
            param = self.leaves[0].param
            return {param.name: Pulled({self: part.materialize()}, param.param.shape)}
        if step >= self.batch:
            leaves = [Dense(g) for g in self.carry(part.materialize())]
        else:
            leaves = [
                Formed(self._formed(part, k), self.batch, v.shape, step)
                for k, v in enumerate(self.values)
            ]
        out: dict[str, Contribution] = {}
        for leaf, c in zip(self.leaves, leaves, strict=True):
            for name, placed in leaf.credit(c).items():
                out[name] = out[name].merge(placed) if name in out else placed
        return out

    def _formed(self, part: Contribution, k: int) -> Callable[[int, int], Tensor]:
        """(lo, hi) -> (hi - lo, *leaf k's shape): examples lo..hi - 1's gradients of leaf k."""
        return lambda lo, hi: self.carry(part.examples(lo, hi).materialize())[k]

    def carry(self, grads: Tensor) -> tuple[Tensor, ...]:
        """(B, *shape) gradients of this tensor -> (B, *leaf shape) per leaf: written out where
        the ops that made it have their batched VJP in ``backs.py``, else one VJP, batched
        (``vjps.py``)."""
        if self.back is not None:
            return self.back(grads)
        return vjps.back(self.kind, self.func, self.values, grads)


Watched = Derived | Computed


def compute(
    func: Callable,
    args: tuple,
    kwargs: dict,
    watched: Callable[[object], Watched | None],
    batch: int,
    constants: Constants | None = None,
) -> Callable[[int | None], Computed]:
    """For an op whose watched arguments (``watched(t)`` not None) are views of parameters or
    tensors computed from them: the ``Computed`` of its output (index ``k`` of a tuple output,
    or None for a tensor), as a function of the leaves of every watched argument, read by a
    batch of ``batch`` examples; pure where its other tensors are among ``constants``, alone
    where it has none and its watched ones are alone."""
    flat, unflatten = flatten(args, kwargs)
    leaves, slots, pure, alone = _sources(flat, watched, constants)
    order = list(leaves)
    position = {key: i for i, key in enumerate(order)}
    constant = [t.detach() if isinstance(t, Tensor) else t for t in flat]
    made = {k: w for k, w, _ in slots}
    shape = (len(args), tuple(kwargs), len(flat))  # how the arguments nest, near enough
    kind = (func, shape, *(_kind(made.get(k), t) for k, t in enumerate(flat)))

    def run(*values: Tensor) -> object:
        items = list(constant)
        for k, w, ids in slots:
            mine = [values[position[i]] for i in ids]
            items[k] = mine[0] if isinstance(w, Derived) else w.func(*mine)
        a, kw = unflatten(items)
        return func(*a, **kw)

    pieces = _pieces(func, args, kwargs, slots)

    def output(index: int | None) -> Computed:
        fn = run if index is None else (lambda *values: run(*values)[index])
        derived, values = (tuple(leaves[i][j] for i in order) for j in (0, 1))
        if index is None:
            written = _written_back(func, args, kwargs, slots)
        else:
            written = _piece(func, args, kwargs, slots, index)
        if written is None:
            kind_of = (index, *kind)
            return Computed(fn, derived, values, batch, pure, pure and alone, kind_of, None, pieces)
        kept, back = written  # the leaves the gradient reaches, and how
        held = {i: leaves[i][1] for i in order}
        at = {key: k for k, key in enumerate(kept)}

        def run_kept(*mine: Tensor) -> object:  # the others held at their values
            return fn(*(mine[at[i]] if i in at else held[i] for i in order))

        derived, values = (tuple(leaves[i][j] for i in kept) for j in (0, 1))
        return Computed(
            run_kept, derived, values, batch, pure, pure and alone, (index, *kind), back
        )

    return output


def _sources(
    flat: list, watched: Callable[[object], Watched | None], constants: Constants | None
) -> tuple[dict[int, tuple[Derived, Tensor]], list[tuple[int, Watched, list[int]]], bool, bool]:
    """An op's flattened arguments' leaves (by the leaf tensor's id), its watched slots
    (position in ``flat``, its watch, its leaves' ids), and whether it is pure and alone."""
    leaves: dict[int, tuple[Derived, Tensor]] = {}
    slots: list[tuple[int, Watched, list[int]]] = []
    pure = alone = True
    for k, t in enumerate(flat):
        w = watched(t) if isinstance(t, Tensor) else None
        if isinstance(w, Derived):
            leaves.setdefault(id(t), (w, t.detach()))
            slots.append((k, w, [id(t)]))
        elif isinstance(w, Computed):
            ids = [id(v) for v in w.values]
            for d, v in zip(w.leaves, w.values, strict=True):
                leaves.setdefault(id(v), (d, v))
            slots.append((k, w, ids))
            pure, alone = pure and w.pure, alone and w.alone
        elif isinstance(t, Tensor):
            pure = pure and constants is not None and t in constants
            alone = False
    return leaves, slots, pure, alone


def _kind(w: Watched | None, item: object) -> object:
    """An argument of an op as ``Computed.kind`` tells it: a watched tensor by what it is, a
    tensor by its shape and dtype, a number or string itself, anything else by its type (no
    id, so that each pass's tensors of one kind are of one kind)."""
    if isinstance(w, Derived):
        return w.param.name, repr(w.place), tuple(item.shape)
    if isinstance(w, Computed):
        return w.kind
    if isinstance(item, Tensor):
        return tuple(item.shape), item.dtype
    if item is None or isinstance(item, (bool, int, float, str, torch.dtype)):
        return item
    return type(item).__name__


def _pieces(
    func: Callable, args: tuple, kwargs: dict, slots: list[tuple[int, Watched, list[int]]]
) -> tuple[int, tuple[int, ...]] | None:
    """Where the op is ``torch.cat`` of whole parameters alone, each once (WavLM's q, k and v
    biases packed for ``F.multi_head_attention_forward``): its dimension and each one's size
    along it (``Computed.pieces``); else None."""
    if op_name(func) != "cat" or not args or type(args[0]) not in (list, tuple):
        return None
    tensors, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else 0)
    whole = all(isinstance(w, Derived) and w.place == Place() for _, w, _ in slots)
    ids = [i for _, _, found in slots for i in found]
    if not (whole and isinstance(dim, int) and len(slots) == len(tensors) == len(set(ids))):
        return None
    return dim % tensors[0].dim(), tuple(t.shape[dim] for t in tensors)


def _piece(
    func: Callable, args: tuple, kwargs: dict, slots: list[tuple[int, Watched, list[int]]], k: int
) -> tuple[list[int], Callable[[Tensor], tuple[Tensor, ...]]] | None:
    """Where the op is ``chunk`` of a cat of whole parameters (``_pieces``) whose piece ``k``
    is one of them exactly (``F.multi_head_attention_forward``'s ``in_proj_bias.chunk(3)``):
    that parameter's leaf id, and its VJP, the gradient itself in its dtype; else None."""
    if op_name(func) != "chunk" or not slots or slots[0][0] != 0:
        return None
    _, first, ids = slots[0]
    if not isinstance(first, Computed) or first.pieces is None:
        return None
    x, (dim, sizes) = args[0], first.pieces
    chunks = kwargs.get("chunks", args[1] if len(args) > 1 else None)
    at = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(chunks, int) or not isinstance(at, int) or at % x.dim() != dim:
        return None
    step = -(-x.shape[dim] // chunks)  # each piece's size, as torch.chunk cuts
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    lo = k * step
    if lo not in starts or sizes[starts.index(lo)] != min(step, x.shape[dim] - lo):
        return None
    j = starts.index(lo)
    dtype = first.values[j].dtype
    return [ids[j]], lambda grads: (grads.to(dtype),)


def _written_back(
    func: Callable, args: tuple, kwargs: dict, slots: list[tuple[int, Watched, list[int]]]
) -> tuple[list[int], Callable[[Tensor], tuple[Tensor, ...]]] | None:
    """Where the op's batched VJP is written out (``backs.py``) and its first argument is a
    watched tensor that is a view of a parameter or was itself carried back so: the ids of the
    leaves the gradient reaches (the first argument's), and the batched VJP to them."""
    if not slots or slots[0][0] != 0:
        return None
    _, first, ids = slots[0]
    if isinstance(first, Computed) and first.back is None:
        return None
    step = back_of(func, args, kwargs)
    if step is None:
        return None
    dtype = args[0].dtype
    if isinstance(first, Derived):
        return ids, lambda grads: (step(grads.to(dtype)),)
    return ids, lambda grads: first.back(step(grads.to(dtype)))
