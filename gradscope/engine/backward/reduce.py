"""What a pass keeps of each parameter's per-example gradient: only the reductions asked for."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...rules import Contribution, Rows, factored
from ...rules.base import Kinds, accumulation_dtype, rows
from ...rules.factored import Reference
from ...rules.projection import Projection
from .batched import Batched


@dataclass(frozen=True)
class Want:
    """The reductions a pass computes: squared norms, inner products with ``refs``
    ({name: (K, *shape)}), the contributions themselves (``keep``: for per-reference gradients),
    and the sum over examples that the first-batch self-check compares with autograd.

    ``transform`` ({name, contribution} -> contribution, linear in the gradient: a
    preconditioner's square root) adds the squared norms of the transformed gradients,
    ``g_i^T P g_i``, beside the plain ones (``Reducer.pre.norm_sq``).

    ``project`` ({name: Projection}, instead of ``refs``): the inner products with the rows of
    a random projection, ``phi_i = P_out^T G_i P_in`` flattened to (B, dim), each answered by
    ``Contribution.project`` without forming the directions; they fill ``inner`` as refs would.
    """

    norms: bool = True
    refs: dict[str, Reference] | None = None  # formed, or factored (``rules.factored``)
    keep: bool = False
    sums: bool = False
    transform: Callable[[str, Contribution], Contribution] | None = None
    # norms and inner products from shared work where a contribution offers it; False when the
    # norms are only the self-check's, so the inner products round as they do without them
    share: bool = True
    project: dict[str, Projection] | None = None
    # a training step's parameters: the one backward also gives the batch gradient of the
    # summed loss for each (``Reducer.trained``), where autograd would leave it in ``.grad``
    train: tuple[Tensor, ...] = ()
    # the names of those whose batch gradient is the sum of the examples' gradients their
    # rules give (``Reducer.sums``), not autograd's: where the norm forms them anyway
    summed: frozenset[str] = frozenset()


_NORMS = Want()  # the squared norms alone


def _forms(groups: list[Contribution]) -> bool:
    """Whether the batch sum of a parameter's parts of several kinds costs little beside their
    norms: one forms each example's gradient, and each other does too or is a table's lookups
    (their sum an ``index_add``: a tied embedding and output head)."""
    formed = [g.forms(train=True) for g in groups]
    return any(formed) and all(
        f or isinstance(g, Rows) for f, g in zip(formed, groups, strict=True)
    )


def _cross(g: Contribution, h: Contribution) -> Tensor:
    """(B,) <G_i, H_i>: the cheap form where one of the two has it, else both formed."""
    cross = g.cross(h)
    if cross is None:
        cross = h.cross(g)
    if cross is None:
        cross = (rows(g.materialize()) * rows(h.materialize())).sum(1)
    return cross


class Reducer:
    """Reduces each parameter's contribution as soon as it is complete, then lets it go.

    A parameter served by one call is reduced when that call's output gradient arrives. One
    served by several calls (a module called twice, a tied weight) keeps its parts until the
    backward ends, then merges them before reducing: the cross terms of its norm need both.
    """

    def __init__(self, want: Want, merged: Iterable[str]):
        self.want = want
        self.norm_sq: dict[str, Tensor] = {}
        self.inner: dict[str, Tensor] = {}
        self.kept: dict[str, Contribution] = {}
        self.sums: dict[str, Tensor] = {}
        # d(summed loss)/d each of ``want.train`` from autograd, None at ``summed_at``'s
        # positions: the names whose sums (``gradients``) the rules give instead
        self.trained: list[Tensor | None] = []
        self.summed_at: dict[int, str] = {}
        # of a training step: the parameters whose rule formed each example's gradient for
        # its norm, whose batch gradient the next step of the signature sums (``want.summed``)
        self.formed: set[str] = set()
        self._parts: dict[str, list[Contribution]] = {name: [] for name in merged}
        # single calls' small norms answered together when the backward ends
        self._batched = Batched() if want.norms else None
        # and their inner products, each with its own references, where not shared with a norm
        self._inners = None if want.refs is None else Batched(want.refs)
        # the transformed gradients' squared norms; each part is transformed as it is reduced,
        # which is exact for merged parts too since the transform is linear
        self.pre = None if want.transform is None else Reducer(Want(norms=True), ())
        # norms and nothing else (most passes), or inner products and nothing else (an
        # influence pass): ``reduce`` asks none of the questions below
        self._norms_only = want == _NORMS
        self._inners_only = want.refs is not None and want == Want(
            norms=False, refs=want.refs, share=want.share
        )

    def hold(self, budget: int, alike: bool = True) -> None:
        """Let the small parts held back to answer together hold ``budget`` elements at most
        (``Batched.budget``). Where no two of the plan's modules are ``alike`` (``Plan.alike``),
        inner products are answered at once: no two weights' parts meet under one key, and
        holding a few biases' costs the host-bound pass more than it saves."""
        if not alike:
            self._inners = None
        for held in (self._batched, self._inners):
            if held is not None:
                held.budget = budget

    def add(self, name: str, part: Contribution) -> None:
        if name in self._parts:
            self._parts[name].append(part)
        else:
            self.reduce(name, part)

    def finish(self) -> None:
        """Merge and reduce what waited for its last call; answer the batched norms.

        Parts of one kind merge and stay factored (positions concatenate). Parts of different
        kinds (a tied embedding and head) are reduced apart and joined through their cross
        terms, ||G + H||^2 = ||G||^2 + ||H||^2 + 2<G, H>, formed only where no cheaper
        form of <G, H> exists; inner products are linear and simply add. A pass that keeps
        the contributions keeps such parts apart too (``Kinds``), none of them formed.
        """
        for name, parts in self._parts.items():
            kinds: dict[type, Contribution] = {}
            for part in parts:
                same = kinds.get(type(part))
                kinds[type(part)] = part if same is None else same.merge(part)
            groups = list(kinds.values())
            if len(groups) == 1:
                self.reduce(name, groups[0])
            elif groups:
                self._reduce_apart(name, groups)
                if self.want.keep:  # kept apart too: formed only where asked
                    self.kept[name] = Kinds(groups)
        self._parts.clear()
        if self._batched is not None:  # what comes later (the fallback's) is answered at once
            self.norm_sq.update(self._batched.answers())
            self._batched = None
        if self._inners is not None:
            self.inner.update(self._inners.answers())
            self._inners = None
        if self.pre is not None:
            self.pre.finish()

    def _reduce_apart(self, name: str, groups: list[Contribution]) -> None:
        if self.pre is not None:
            self.pre._reduce_apart(name, [self.want.transform(name, g) for g in groups])
        refs = self.want.refs[name] if self.want.refs is not None else None
        if self.want.train and _forms(groups):
            self.formed.add(name)
        if self.want.norms and refs is not None and self.want.share:
            both = [factored.norm_sq_and_inner(g, refs) for g in groups]
            norm_sq, self.inner[name] = sum(n for n, _ in both), sum(i for _, i in both)
        else:
            if self.want.norms and name in self.want.summed:
                both = [g.norm_sq_and_sum() for g in groups]
                norm_sq, self.sums[name] = sum(n for n, _ in both), sum(t for _, t in both)
            elif self.want.norms:
                norm_sq = sum(g.norm_sq() for g in groups)
            if refs is not None:
                self.inner[name] = sum(factored.inner(g, refs) for g in groups)
        if self.want.project is not None:  # linear in the gradient: the kinds' answers add
            self.inner[name] = sum(g.project(self.want.project[name]) for g in groups)
        if self.want.norms:
            for k, g in enumerate(groups):
                for h in groups[k + 1 :]:
                    norm_sq = norm_sq + 2 * _cross(g, h)
            self.norm_sq[name] = norm_sq
        if (self.want.sums or name in self.want.summed) and name not in self.sums:
            self.sums[name] = sum(g.batch_sum() for g in groups)

    def reduce(self, name: str, c: Contribution) -> None:
        if self._norms_only:  # after ``finish`` (the fallback's parts): at once
            if self._batched is None or not self._batched.take(name, c):
                self.norm_sq[name] = c.norm_sq()
            return
        if self._inners_only:
            if self._inners is None or not self._inners.take(name, c):
                self.inner[name] = factored.inner(c, self.want.refs[name])
            return
        if self.pre is not None:
            self.pre.reduce(name, self.want.transform(name, c))
        refs = self.want.refs[name] if self.want.refs is not None else None
        if self.want.train and c.forms(train=True):
            self.formed.add(name)
        if self.want.norms and refs is not None and self.want.share:
            self.norm_sq[name], self.inner[name] = factored.norm_sq_and_inner(c, refs)
        else:
            summed = name in self.want.summed  # its norm and sum from G formed, not a Gram
            batched = not summed and self._batched is not None and self._batched.take(name, c)
            if self.want.norms and not batched and summed:
                self.norm_sq[name], self.sums[name] = c.norm_sq_and_sum()
            elif self.want.norms and not batched:
                self.norm_sq[name] = c.norm_sq()
            inners = self._inners is not None and self._inners.take(name, c)
            if refs is not None and not inners:
                self.inner[name] = factored.inner(c, refs)
        if self.want.project is not None:
            self.inner[name] = c.project(self.want.project[name])
        if self.want.keep:
            self.kept[name] = c
        if (self.want.sums or name in self.want.summed) and name not in self.sums:
            self.sums[name] = c.batch_sum()

    def gradients(self) -> list[Tensor | None]:
        """d(summed loss)/d each of ``want.train``: autograd's, or the sum of the examples'
        gradients for ``want.summed``'s (the fallback's where a rule failed on the batch; None
        where no call reached the loss, as autograd's)."""
        at = self.summed_at
        return [self.sums.get(at[k]) if k in at else g for k, g in enumerate(self.trained)]

    def answered(
        self,
        name: str,
        norm_sq: Tensor | None,
        inner: Tensor | None,
        batch_sum: Callable[[], Tensor] | None,
    ) -> None:
        """What was answered elsewhere (``grouped.Grouped``): a squared norm and inner products
        where asked for, and the sum over the examples where the self-check or a training
        step's ``want.summed`` asks for it."""
        if norm_sq is not None:
            self.norm_sq[name] = norm_sq
        if inner is not None:
            self.inner[name] = inner
        if batch_sum is not None:
            self.sums[name] = batch_sum()

    def forget(self, name: str) -> None:
        """Drop what a parameter's rule gave: the fallback serves it instead."""
        for store in (self.norm_sq, self.inner, self.kept, self.sums):
            store.pop(name, None)
        if self.pre is not None:
            self.pre.forget(name)

    def zeros(self, name: str, batch: int, param: Tensor) -> None:
        """Where no call of ``param`` reached the loss: every example's gradient is zero."""
        want = self.want
        if (
            (not want.norms or name in self.norm_sq)
            and ((want.refs is None and want.project is None) or name in self.inner)
            and not want.sums
            and self.pre is None
        ):
            return  # each asked for is there: most parameters of most passes
        # plain tensors on the parameter's device, also for a sharded (DTensor) parameter
        like = {"dtype": accumulation_dtype(param.dtype), "device": param.device}
        if self.pre is not None:
            self.pre.zeros(name, batch, param)
        if self.want.norms and name not in self.norm_sq:
            self.norm_sq[name] = torch.zeros(batch, **like)
        if self.want.refs is not None and name not in self.inner:
            k = len(self.want.refs[name])
            self.inner[name] = torch.zeros(batch, k, **like)
        if self.want.project is not None and name not in self.inner:
            self.inner[name] = torch.zeros(batch, self.want.project[name].dim, **like)
        if self.want.sums:
            self.sums.setdefault(name, torch.zeros_like(param))
