"""Reference directions of an outer-product weight kept as their factors, R_k = sum_n u_kn v_kn^T,
as the reference pass's output gradients and inputs give them: an example's inner product with
R_k is then sum_t sum_n (s_t . u_n)(a_t . v_n), the Gram trick the norms use, where through R
formed it costs T * O * I."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .base import CHUNK_ELEMENTS, Contribution, _cat
from .outer import Outer

# Multiply-adds the factored inner products must save over a batch: their route runs a few
# more ops (two products, their product, a sum), whose dispatch a small layer's batch does not
# earn back: the bench's T3 (MLP 32-64-64-1, batch 64, 8 reference rows; 196k multiply-adds
# saved a layer) scored 21 us slower over its two layers from the factors than through R, 4%
# of its norms pass (CPU time, one thread). 2^20 at some 20 G a second: ~50 us.
DISPATCH = 1 << 20


class Factored:
    """K reference directions of a parameter an Outer serves, each R_k (its (G*O, I) matrix)
    the sum over N positions of u_kgn v_kgn^T, group by group: ``u`` (K, G, N, O), ``v``
    (K, G, N, I), ``shape`` the parameter's. Where a contribution cannot use them, or uses R
    formed for less, R is formed once (``dense``) and kept."""

    def __init__(self, u: Tensor, v: Tensor, shape: torch.Size):
        self.u, self.v, self.param_shape = u, v, torch.Size(shape)
        self._dense: Tensor | None = None

    def __len__(self) -> int:
        return self.u.shape[0]

    @property
    def as_outer(self) -> Outer:
        """The K directions as an Outer of K examples: its norms and its gradients formed."""
        return Outer(self.u, self.v, self.param_shape)

    def dense(self) -> Tensor:
        """(K, *shape) the directions formed, once."""
        if self._dense is None:
            self._dense = self.as_outer.materialize()
        return self._dense

    def norm_sq(self) -> Tensor:
        """(K,) ||R_k||^2, from the factors' Grams (or R formed, where the Outer forms it)."""
        return self.as_outer.norm_sq()

    def pays(self, c: Contribution, norms: bool = False) -> bool:
        """Whether ``c``'s inner products come from these factors: an Outer of this parameter's
        groups, outputs and inputs, whose products cost less from them (``cheaper``)."""
        if type(c) is not Outer or c.shape != self.param_shape:
            return False
        _, g, _, o, i = c.dims
        if self.u.shape[1] != g or self.u.shape[3] != o or self.v.shape[3] != i:
            return False
        return cheaper(c, self.u.shape[0], self.u.shape[2], norms)

    def inner(self, c: Outer) -> Tensor:
        """(B, K) <G_i, R_k> of an Outer that the factors fit (``pays``: an Outer of this
        parameter's groups, outputs and inputs); zero positions (``Outer.lengths``' padding) add
        nothing."""
        return factored_inner(c.s, c.a, self.u.to(c.s.dtype), self.v.to(c.a.dtype))


def cheaper(c: Outer, k: int, n: int, norms: bool = False, each: bool = False) -> bool:
    """Whether K directions of N positions each give ``c``'s inner products for less, T * K *
    N * (O + I) products an example, than the Outer's own route through R formed: T * K * O *
    I through R, (T + K) * O * I from each G_i formed where that is less, K * O * I where its
    norm (``norms``: answered together, ``Outer.norm_sq_and_inner``) forms G_i anyway; and
    by at least ``DISPATCH`` over the batch, which the factors' few more ops cost more than at
    a small layer's, or where the route through R would hold more than the layer's rows
    (``each``: for one example, where the batches are not known yet: a reference kept, which
    the batches then take formed where it does not pay)."""
    b, _, t, o, i = c.dims
    formed = min(t * k, t + k) * o * i
    if norms and c.forms(train=False):
        formed = k * o * i
    saved = formed - t * k * n * (o + i + 1)
    # through R, each position holds K * min(O, I) products, the factors' K * N: where the first
    # is more than the position's own inputs and output gradients, the factors keep the peak
    # (T3's --per-ref through R was 2.4x a backward's, its layers too small to pay by time)
    held = k * min(o, i) > max(o + i, k * n)
    return saved > 0 and (each or held or b * saved >= DISPATCH)


Reference = Tensor | Factored  # (K, *shape), formed or factored


def factored_inner(s: Tensor, a: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """(B, K) sum_g sum_t sum_n (s_bgt . u_kgn)(a_bgt . v_kgn): s (B, G, T, O), a (B, G, T, I),
    u (K, G, N, O), v (K, G, N, I); a few examples and references at a time, so that no
    (G, b*T, k*N) product past ``CHUNK_ELEMENTS`` is held."""
    b, g, t, o = s.shape
    k, _, n, i = v.shape
    if t == 0 or n == 0:  # no position of one side: every product is zero
        return s.new_zeros(b, k)
    k_step = max(1, CHUNK_ELEMENTS // (g * t * n))
    cols = []
    for k_lo in range(0, k, k_step):
        us, vs = _by_group(u[k_lo : k_lo + k_step]), _by_group(v[k_lo : k_lo + k_step])
        kc = min(k_step, k - k_lo)
        step = max(1, CHUNK_ELEMENTS // (g * t * kc * n))
        rows = []
        for lo in range(0, b, step):
            sc, ac = _by_group(s[lo : lo + step]), _by_group(a[lo : lo + step])
            both = (sc @ us.mT) * (ac @ vs.mT)  # (G, b*T, k*N)
            bc = min(step, b - lo)
            rows.append(both.view(g, bc, t, kc, n).sum((0, 2, 4)))  # (b, k)
        cols.append(_cat(rows))
    return _cat(cols, 1)


def _by_group(x: Tensor) -> Tensor:
    """(m, G, L, d) -> (G, m*L, d), or (m*L, d) where G is 1: a view, and a two-dimensional
    product, which runs a fifth faster than a batched one of one matrix."""
    m, g, length, d = x.shape
    if g == 1:
        return x.reshape(m * length, d)
    return x.transpose(0, 1).reshape(g, m * length, d)


def dense(ref: Reference) -> Tensor:
    """(K, *shape) a reference formed: itself where it is."""
    return ref.dense() if isinstance(ref, Factored) else ref


def inner(c: Contribution, ref: Reference, norms: bool = False) -> Tensor:
    """(B, K) ``c``'s inner products with ``ref``: from the factors where ``c`` is an Outer
    they fit and cost less (``Factored.pays``), else through R formed."""
    if isinstance(ref, Factored):
        if ref.pays(c, norms):
            return ref.inner(c)
        ref = ref.dense()
    return c.inner(ref)


def norm_sq_and_inner(c: Contribution, ref: Reference) -> tuple[Tensor, Tensor]:
    """``c.norm_sq_and_inner`` with ``ref`` formed or, where it pays, the squared norms and the
    factored inner products apart."""
    if isinstance(ref, Factored):
        if ref.pays(c, norms=True):
            return c.norm_sq(), ref.inner(c)
        ref = ref.dense()
    return c.norm_sq_and_inner(ref)


def inners(part: Contribution, refs: Sequence[Reference], batch: int) -> Tensor:
    """``part.inners``: (n, batch, K) of n calls' examples stacked in ``part``, each against its
    own reference; call by call where a factored reference pays its factors on a call's
    examples (``inner``), else with those references formed, stacked with the others (a BERT
    classifier's 12 alike query layers, the last one's reference factored, its 8 [CLS] rows all
    that reach it: one product, not 12)."""
    if any(isinstance(r, Factored) for r in refs):
        one = part.examples(0, batch) if type(part) is Outer else None  # every call's alike
        if one is not None and any(isinstance(r, Factored) and r.pays(one) for r in refs):
            return torch.stack(
                [inner(part.examples(k * batch, (k + 1) * batch), r) for k, r in enumerate(refs)]
            )
        refs = [dense(r) for r in refs]
    return part.inners(refs, batch)
