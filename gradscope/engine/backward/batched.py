"""Small reductions held back until the backward ends and answered one batched op per shape:
``Batched``, which the reducer (``reduce.py``) hands its parts to."""

from __future__ import annotations

import torch
from torch import Tensor

from ...rules import Contribution, Dense, Outer
from ...rules.base import CHUNK_ELEMENTS, _sq_norm, rows
from ...rules.factored import Factored, Reference, dense
from ...rules.ghost import gram_norms
from ...rules.routed import Routed, routed_inners, routed_norms

# A formed gradient (a bias's) of more elements is answered at once, and so is any part's inner
# products: stacking it with others would copy more than the dispatch of its own answer costs.
HELD_DENSE = 1 << 16


class Batched:
    """Norms, or inner products with ``refs`` (each part its own parameter's), held back until the
    backward ends, then answered one batched op per shape (norms: Outers of one Gram block by
    ``rules.ghost.gram_norms``, routed experts' reads by ``rules.routed.routed_norms``, formed
    gradients by one norm; inner products: Outers by ``Outer.inners`` of their examples stacked,
    routed reads by ``rules.routed.routed_inners``, formed gradients by one product), while what
    they hold stays under ``budget`` elements (past it, every part held so far is answered at once;
    ``Reducer.hold`` sets it for a pass): the host-bound passes, where each call's few small ops
    cost more to dispatch than to compute."""

    def __init__(self, refs: dict[str, Reference] | None = None):
        self.refs = refs
        self._held: dict[tuple, list[tuple[str, Contribution, int]]] = {}  # and its size
        self._size = 0
        self.budget = CHUNK_ELEMENTS  # elements held at most: past it, all held are answered
        self.done: dict[str, Tensor] = {}

    def take(self, name: str, c: Contribution) -> bool:
        """Hold ``c`` back where it is an Outer or a Routed of one Gram block (for inner
        products: an Outer of every position, a Routed of ``sorted_route``), or formed
        gradients (a bias, a norm's scale; for norms, of at most ``HELD_DENSE`` elements, and
        not a one-position Linear's bias, whose norm its weight's computes); for inner products,
        each part of at most ``HELD_DENSE`` elements, its references formed where factored ones
        do not pay on it (where they do, it is answered alone: ``rules.factored.inner``); False
        where not taken."""
        ref = None if self.refs is None else self.refs[name]
        if isinstance(ref, Factored) and ref.pays(c):
            return False
        key = _norm_key(c) if ref is None else _inner_key(c, len(ref))
        if key is None:
            return False
        size = _size(c)
        if self.refs is not None and size > HELD_DENSE:
            return False
        self._held.setdefault(key, []).append((name, c, size))
        self._size += size
        if self._size > self.budget:
            for shape in list(self._held):
                self._answer(shape)
        return True

    def _answer(self, key: tuple) -> None:
        held = self._held.pop(key)
        names, parts = [name for name, _, _ in held], [c for _, c, _ in held]
        if len(parts) == 1:  # nothing alike came: its own answer, nothing stacked
            c = parts[0]
            answers = [c.norm_sq() if self.refs is None else c.inner(dense(self.refs[names[0]]))]
        elif self.refs is None:
            answers = _norms(key[0], parts)
        else:
            answers = _inners(key[0], parts, [dense(self.refs[n]) for n in names])
        self.done.update(zip(names, answers, strict=True))
        self._size -= sum(size for _, _, size in held)

    def answers(self) -> dict[str, Tensor]:
        for key in list(self._held):
            self._answer(key)
        return self.done


def _norm_key(c: Contribution) -> tuple | None:
    if type(c) is Outer and c.one_gram:  # types, not isinstance: an ABC's costs a call
        return (Outer, c.dims, c.s.dtype, c.s.device)
    if type(c) is Routed and c.one_gram:
        return (Routed, c.a.shape, c.s.shape, c.shape[0], c.batch, c.s.dtype, c.s.device)
    # a Dense with ``sq``: its norm is its weight's factor, no op of its own to batch
    if type(c) is Dense and c.sq is None and c.grads.numel() <= HELD_DENSE:
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


def _inners(kind: type, parts: list, refs: list[Tensor]) -> Tensor:
    """(n, B, K) the inner products of n parts of one ``_inner_key``, each with its own
    references, ``refs`` n (K, *shape)."""
    if kind is Routed:
        return routed_inners(parts, refs)
    if kind is Outer:  # the n parts' examples stacked, (n*B, G, T, O) and (n*B, G, T, I)
        s, a = torch.cat([c.s for c in parts]), torch.cat([c.a for c in parts])
        return Outer(s, a, parts[0].shape).inners(refs, parts[0].dims[0])
    grads = torch.cat([c.grads for c in parts])  # (n*B, *shape)
    return Dense(grads).inners(refs, parts[0].grads.shape[0])


def _size(c: Contribution) -> int:
    """The elements a held contribution keeps alive."""
    kind = type(c)
    if kind is Routed:  # and the Gram of its rows
        return c.s.numel() + c.a.numel() + c.a.shape[0] ** 2
    return c.s.numel() + c.a.numel() if kind is Outer else c.grads.numel()
