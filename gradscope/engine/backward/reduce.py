"""What a pass keeps of each parameter's per-example gradient: only the reductions asked for."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...rules import Contribution, Dense, Outer
from ...rules.base import CHUNK_ELEMENTS, _sq_norm, accumulation_dtype, rows
from ...rules.outer import gram_norms
from ...rules.projection import Projection
from ...rules.routed import Routed, routed_inners, routed_norms


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
    refs: dict[str, Tensor] | None = None
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


def _merged(parts: list[Contribution]) -> Contribution:
    merged = parts[0]
    for part in parts[1:]:
        merged = merged.merge(part)
    return merged


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
        self.trained: list[Tensor | None] = []  # d(summed loss)/d each of ``want.train``
        self._parts: dict[str, list[Contribution]] = {name: [] for name in merged}
        # single calls' small norms answered together when the backward ends
        self._batched = Batched() if want.norms else None
        # and their inner products, each with its own references, where not shared with a norm
        self._inners = None if want.refs is None else Batched(want.refs)
        # the transformed gradients' squared norms; each part is transformed as it is reduced,
        # which is exact for merged parts too since the transform is linear
        self.pre = None if want.transform is None else Reducer(Want(norms=True), ())

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
        form of <G, H> exists; inner products are linear and simply add.
        """
        for name, parts in self._parts.items():
            kinds: dict[type, Contribution] = {}
            for part in parts:
                same = kinds.get(type(part))
                kinds[type(part)] = part if same is None else same.merge(part)
            groups = list(kinds.values())
            if len(groups) == 1 or (groups and self.want.keep):
                self.reduce(name, _merged(groups))
            elif groups:
                self._reduce_apart(name, groups)
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
        if self.want.norms and refs is not None and self.want.share:
            both = [g.norm_sq_and_inner(refs) for g in groups]
            norm_sq, self.inner[name] = sum(n for n, _ in both), sum(i for _, i in both)
        else:
            if self.want.norms:
                norm_sq = sum(g.norm_sq() for g in groups)
            if refs is not None:
                self.inner[name] = sum(g.inner(refs) for g in groups)
        if self.want.project is not None:  # linear in the gradient: the kinds' answers add
            self.inner[name] = sum(g.project(self.want.project[name]) for g in groups)
        if self.want.norms:
            for k, g in enumerate(groups):
                for h in groups[k + 1 :]:
                    norm_sq = norm_sq + 2 * _cross(g, h)
            self.norm_sq[name] = norm_sq
        if self.want.sums:
            self.sums[name] = sum(g.batch_sum() for g in groups)

    def reduce(self, name: str, c: Contribution) -> None:
        if self.pre is not None:
            self.pre.reduce(name, self.want.transform(name, c))
        refs = self.want.refs[name] if self.want.refs is not None else None
        if self.want.norms and refs is not None and self.want.share:
            self.norm_sq[name], self.inner[name] = c.norm_sq_and_inner(refs)
        else:
            batched = self._batched is not None and self._batched.take(name, c)
            if self.want.norms and not batched:
                self.norm_sq[name] = c.norm_sq()
            inners = self._inners is not None and self._inners.take(name, c)
            if refs is not None and not inners:
                self.inner[name] = c.inner(refs)
        if self.want.project is not None:
            self.inner[name] = c.project(self.want.project[name])
        if self.want.keep:
            self.kept[name] = c
        if self.want.sums:
            self.sums[name] = c.batch_sum()

    def answered(
        self,
        name: str,
        norm_sq: Tensor | None,
        inner: Tensor | None,
        batch_sum: Callable[[], Tensor] | None,
    ) -> None:
        """What was answered elsewhere (``grouped.Grouped``): a squared norm and inner products
        where asked for, and the sum over the examples where the self-check asks for it."""
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
        # plain tensors on the parameter's device, also for a sharded (DTensor) parameter
        like = {"dtype": accumulation_dtype(param.dtype), "device": param.device}
        if self.pre is not None:
            self.pre.zeros(name, batch, param)
        if self.want.norms and name not in self.norm_sq:
            self.norm_sq[name] = torch.zeros(batch, **like)
        if self.want.refs is not None and name not in self.inner:
            k = self.want.refs[name].shape[0]
            self.inner[name] = torch.zeros(batch, k, **like)
        if self.want.project is not None and name not in self.inner:
            self.inner[name] = torch.zeros(batch, self.want.project[name].dim, **like)
        if self.want.sums:
            self.sums.setdefault(name, torch.zeros_like(param))


class Batched:
    """Norms, or inner products with ``refs`` (each part its own parameter's), held back until
    the backward ends, then answered one batched op per shape (norms: Outers of one Gram block
    by ``rules.outer.gram_norms``, routed experts' reads by ``rules.routed.routed_norms``,
    formed gradients by one norm; inner products: Outers by ``Outer.inners`` of their examples
    stacked, routed reads by ``rules.routed.routed_inners``, formed gradients by one product),
    while what they hold stays under ``CHUNK_ELEMENTS`` (past it, a shape's parts are answered
    at once): the host-bound passes, where each call's few small ops cost more to dispatch
    than to compute."""

    def __init__(self, refs: dict[str, Tensor] | None = None):
        self.refs = refs
        self._held: dict[tuple, list[tuple[str, Contribution]]] = {}
        self._size = 0
        self.done: dict[str, Tensor] = {}

    def take(self, name: str, c: Contribution) -> bool:
        """Hold ``c`` back where it is an Outer or a Routed of one Gram block (for inner
        products: an Outer of every position, a Routed of ``sorted_route``), or formed
        gradients (a bias, a norm's scale); False where not taken."""
        key = _norm_key(c) if self.refs is None else _inner_key(c, len(self.refs[name]))
        if key is None:
            return False
        held = self._held.setdefault(key, [])
        held.append((name, c))
        self._size += _size(c)
        if self._size > CHUNK_ELEMENTS:
            self._answer(key)
        return True

    def _answer(self, key: tuple) -> None:
        held = self._held.pop(key)
        names, parts = [name for name, _ in held], [c for _, c in held]
        if len(parts) == 1:  # nothing alike came: its own answer, nothing stacked
            c = parts[0]
            answers = [c.norm_sq() if self.refs is None else c.inner(self.refs[names[0]])]
        elif self.refs is None:
            answers = _norms(key[0], parts)
        else:
            answers = _inners(key[0], parts, torch.stack([self.refs[n] for n in names]))
        self.done.update(zip(names, answers, strict=True))
        self._size -= sum(_size(c) for c in parts)

    def answers(self) -> dict[str, Tensor]:
        for key in list(self._held):
            self._answer(key)
        return self.done


def _norm_key(c: Contribution) -> tuple | None:
    if isinstance(c, Outer) and c.one_gram:
        return (Outer, c.dims, c.s.dtype, c.s.device)
    if type(c) is Routed and c.one_gram:
        return (Routed, c.a.shape, c.s.shape, c.shape[0], c.batch, c.s.dtype, c.s.device)
    if type(c) is Dense:
        return (Dense, c.grads.shape[0], c.shape.numel(), c.grads.dtype, c.grads.device)
    return None


def _inner_key(c: Contribution, k: int) -> tuple | None:
    if type(c) is Outer and c.lengths is None:
        return (Outer, c.dims, c.shape, k, c.s.dtype, c.s.device)
    if type(c) is Routed and c.sorted_route:
        return (Routed, c.a.shape[1], c.s.shape[1], c.shape, c.batch, c.transposed, k)
    if type(c) is Dense:
        return (Dense, c.grads.shape, k, c.grads.dtype, c.grads.device)
    return None


def _norms(kind: type, parts: list) -> Tensor:
    """(n, B) the squared norms of n parts of one ``_norm_key``."""
    if kind is Outer:
        return gram_norms(parts)
    if kind is Routed:
        return routed_norms(parts)
    return _sq_norm(torch.stack([rows(c.grads) for c in parts]))  # (n, B, P) -> (n, B)


def _inners(kind: type, parts: list, refs: Tensor) -> Tensor:
    """(n, B, K) the inner products of n parts of one ``_inner_key``, each with its own
    references, ``refs`` (n, K, *shape)."""
    if kind is Routed:
        return routed_inners(parts, refs)
    if kind is Outer:  # the n parts' examples stacked, (n*B, G, T, O) and (n*B, G, T, I)
        s, a = torch.cat([c.s for c in parts]), torch.cat([c.a for c in parts])
        return Outer(s, a, parts[0].shape).inners(refs, parts[0].dims[0])
    grads = torch.cat([c.grads for c in parts])  # (n*B, *shape)
    return Dense(grads).inners(refs, parts[0].grads.shape[0])


def _size(c: Contribution) -> int:
    """The elements a held contribution keeps alive."""
    if isinstance(c, Routed):  # and the Gram of its rows
        return c.s.numel() + c.a.numel() + c.a.shape[0] ** 2
    return c.s.numel() + c.a.numel() if isinstance(c, Outer) else c.grads.numel()
