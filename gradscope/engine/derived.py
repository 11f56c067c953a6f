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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rules import Contribution, Dense, base
from ..rules.formed import Formed
from ..rules.placed import Place, Placed
from .backs import back_of
from .ops import WRITES_IN_PLACE
from .plan import ParamPlan
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
    # (B, *its shape) gradients -> (B, *leaf shape) per leaf, written out (``backs.py``)
    back: Callable[[Tensor], tuple[Tensor, ...]] | None = None

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
            leaves = [Dense(g) for g in self._back(part.materialize())]
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
        return lambda lo, hi: self._back(part.examples(lo, hi).materialize())[k]

    def _back(self, grads: Tensor) -> tuple[Tensor, ...]:
        """(B, *shape) gradients of this tensor -> (B, *leaf shape) per leaf: written out where
        the ops that made it have their batched VJP in ``backs.py``, else one VJP, batched."""
        if self.back is not None:
            return self.back(grads)
        value, vjp = torch.func.vjp(self.func, *self.values)
        grads = grads.to(value.dtype)
        try:
            return torch.func.vmap(vjp)(grads)
        except Exception:  # an op without a batching rule (vmap's message varies): one at a time
            per = [vjp(g) for g in grads]
            return tuple(torch.stack(gs) for gs in zip(*per, strict=True))


class Pulled(Contribution):
    """One parameter's per-example gradient through tensors ``Computed`` from it alone, kept as
    each tensor's (B, *its shape) gradients until asked for: the reads of one tensor (Mistral
    Large 4's rotary table scaled by a learned ``alpha``, read by each query and key) merge by
    adding those, and one VJP per tensor then forms the parameter's, where one per read would
    give the same sum (the VJP is linear in the gradient)."""

    forms = True

    def __init__(self, pending: dict[Computed, Tensor], shape: torch.Size):
        self.pending = pending  # each tensor computed from the parameter -> its gradients
        self.shape = shape

    @functools.cached_property
    def formed(self) -> Dense:
        grads = [computed._back(g)[0] for computed, g in self.pending.items()]
        return Dense(functools.reduce(torch.add, grads))

    def norm_sq(self) -> Tensor:
        return self.formed.norm_sq()

    def inner(self, refs: Tensor) -> Tensor:
        return self.formed.inner(refs)

    def materialize(self) -> Tensor:
        return self.formed.grads

    def merge(self, other: Contribution) -> Contribution:
        if not isinstance(other, Pulled):
            return self.formed.merge(other)
        pending = dict(self.pending)
        for computed, g in other.pending.items():
            pending[computed] = pending[computed] + g if computed in pending else g
        return Pulled(pending, self.shape)


Watched = Derived | Computed

# functions whose result is made from numbers alone: shapes, ranges, fills (not ``torch.tensor``,
# whose numbers may have been read from the batch)
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye}
FACTORIES |= {torch.linspace, torch.logspace, torch.zeros_like, torch.ones_like}
FACTORIES |= {torch.full_like, torch.empty_like, Tensor.new_zeros, Tensor.new_ones}
FACTORIES |= {Tensor.new_full, Tensor.new_empty}


class Constants:
    """The tensors of one forward (or one region call) made from numbers and the model's
    buffers alone: a factory's result, or an op's on such tensors only. Every example reads
    the same value, by construction, so a tensor made from parameters and these is ``pure``:
    the analysis and a light region tell them the same way, without the trace. An in-place
    edit of one of them by anything else ends every one that shares its storage (a view of it,
    what it is a view of: RWKV's output written step by step leaves its ``max_state`` one), or
    all of them where that is a buffer's, whose views it does not hold."""

    def __init__(self, buffers: frozenset[int] = frozenset(), made: Sequence[Tensor] = ()):
        self.ids = set(buffers) | {id(t) for t in made}
        self.alive: list[Tensor] = list(made)  # held: no other tensor takes an id of theirs
        self.spoiled = False

    def __contains__(self, t: object) -> bool:
        return not self.spoiled and id(t) in self.ids

    def after(self, func, name: str, tensors: Sequence[Tensor], kwargs: dict, out) -> None:
        """Follow an op (``tensors``: its tensor arguments) whose result is ``out``."""
        made = func in FACTORIES or (tensors and all(id(t) in self.ids for t in tensors))
        if writes(name, kwargs):
            target = kwargs.get("out", tensors[0] if tensors else None)
            if not made and any(id(t) in self.ids for t in tensors):
                self._written(target)
            return
        if made:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor):
                    self.ids.add(id(t))
                    self.alive.append(t)

    def _written(self, t: object) -> None:
        """``t`` written in place by an op on more than constants: it, and every constant
        sharing its storage, are constants no more; where that storage may be a buffer's (``t``
        one, or a view of a tensor held as no made one), none is. Asked of the tensors with
        every function mode off: the trace beneath the tap would take it for the model's op."""
        alive = {id(a) for a in self.alive}
        with torch._C.DisableTorchFunction():
            base = t._base if isinstance(t, Tensor) and t._base is not None else t
            storage = storage_of(t)
            held = isinstance(t, Tensor) and not any(id(u) in self.ids - alive for u in (t, base))
            if storage is None or not held:
                self.spoiled = True
                return
            gone = {id(a) for a in self.alive if storage_of(a) in (storage, None)}
        self.ids -= gone | {id(t)}
        self.alive = [a for a in self.alive if id(a) not in gone]


def storage_of(t: object) -> int | None:
    """Where ``t``'s storage begins, or None where it has none to tell: not a tensor, or a
    tensor ``vmap`` batches (``torch.func`` inside a model, a computed read's VJP), whose
    storage torch does not give. Asked with function modes off."""
    if not isinstance(t, Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def writes(name: str, kwargs: dict) -> bool:
    """Whether op ``name`` writes a tensor: an in-place edit, or ``out=``."""
    inplace = (name.endswith("_") and not name.endswith("__")) or name in WRITES_IN_PLACE
    return inplace or "out" in kwargs


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
    leaves: dict[int, tuple[Derived, Tensor]] = {}  # by the leaf tensor's id
    slots: list[tuple[int, Watched, list[int]]] = []  # (position in flat, its watch, leaf ids)
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
    order = list(leaves)
    position = {key: i for i, key in enumerate(order)}
    constant = [t.detach() if isinstance(t, Tensor) else t for t in flat]

    def run(*values: Tensor) -> object:
        items = list(constant)
        for k, w, ids in slots:
            mine = [values[position[i]] for i in ids]
            items[k] = mine[0] if isinstance(w, Derived) else w.func(*mine)
        a, kw = unflatten(items)
        return func(*a, **kw)

    def output(index: int | None) -> Computed:
        fn = run if index is None else (lambda *values: run(*values)[index])
        derived, values = (tuple(leaves[i][j] for i in order) for j in (0, 1))
        written = _written_back(func, args, kwargs, slots) if index is None else None
        if written is None:
            return Computed(fn, derived, values, batch, pure, pure and alone)
        kept, back = written  # the leaves the gradient reaches, and how
        held = {i: leaves[i][1] for i in order}
        at = {key: k for k, key in enumerate(kept)}

        def run_kept(*mine: Tensor) -> object:  # the others held at their values
            return run(*(mine[at[i]] if i in at else held[i] for i in order))

        derived, values = (tuple(leaves[i][j] for i in kept) for j in (0, 1))
        return Computed(run_kept, derived, values, batch, pure, pure and alone, back)

    return output


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
