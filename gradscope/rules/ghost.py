"""The products of an outer-product layer's ghost (its inputs and output gradients, never each
example's gradient G_i): inner products with references through R, and the Gram norms of many
calls of one shape in one batched product, or of one call in blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .base import CHUNK_ELEMENTS

if TYPE_CHECKING:
    from .outer import Outer


def ghost_inner(r: Tensor, s: Tensor, a: Tensor) -> Tensor:
    """(*n, B, K) sum_t s_t^T R a_t of n calls' examples, each call's with its own references:
    r (*n, K, G, O, I), s (*n, B, G, T, O), a (*n, B, G, T, I), where ``n`` is one leading dim
    or none (one call: two-dimensional products, no stack of one). The inputs (or the output
    gradients, where fewer) through R by one matrix product where G is 1, never forming G_i;
    the sum over positions and the narrower side by a cascade, not a matrix product's inner dim
    (``base.BLOCK``): G * T * min(O, I) terms of one example."""
    *n, k, g, o, i = r.shape
    b, t = s.shape[-4], s.shape[-2]
    if g == 1 and t == 1 and not n and k == 1:  # one call, one reference, one position: the
        # (B, 1, 1, .) rows through R as they lie (no call for R^T or a view), the narrower side
        # out, then its product with the other summed over its dims (B, 1)
        if o <= i:  # s^T (R a)
            return torch.nn.functional.linear(a, r.reshape(o, i)).mul_(s).sum((2, 3))
        return torch.matmul(s, r.reshape(o, i)).mul_(a).sum((2, 3))  # (s^T R) a
    if g == 1 and t == 1 and o <= i:  # one position: (*n, B, I) @ (*n, I, K*O) -> (*n, B, K, O)
        # reshape, not view: a reference through a preconditioner need not be contiguous
        ra = torch.matmul(a.reshape(*n, b, i), r.reshape(*n, k * o, i).mT).view(*n, b, k, o)
        return ra.mul_(s.reshape(*n, b, 1, o)).sum(-1)  # in place: no second (B, K, O)
    if g == 1 and o <= i:  # (*n, B*T, I) @ (*n, I, K*O) -> (*n, B, T, K, O)
        ra = torch.matmul(a.reshape(*n, b * t, i), r.reshape(*n, k * o, i).mT)
        return ra.view(*n, b, t, k, o).mul_(s.reshape(*n, b, t, 1, o)).sum((-3, -1))
    if g == 1:  # (*n, B*T, O) @ (*n, O, K*I) -> (*n, B, T, K, I)
        rt = r.reshape(*n, k, o, i).transpose(-3, -2).reshape(*n, o, k * i)
        rs = torch.matmul(s.reshape(*n, b * t, o), rt).view(*n, b, t, k, i)
        return rs.mul_(a.reshape(*n, b, t, 1, i)).sum((-3, -1))
    if o <= i:
        ra = torch.einsum("...kgoi,...bgti->...bkgto", r, a)  # (*n, B, K, G, T, O)
        return (ra * s.unsqueeze(-4)).flatten(-3).sum(-1)
    rs = torch.einsum("...kgoi,...bgto->...bkgti", r, s)  # (*n, B, K, G, T, I)
    return (rs * a.unsqueeze(-4)).flatten(-3).sum(-1)


def gram_norms(parts: Sequence[Outer]) -> Tensor:
    """(n, B) ``norm_sq`` of n Outers of one shape whose norm is ``one_gram``, in one batched
    product: at small sizes, where each call's few products cost their dispatch more than their
    arithmetic, the calls of a backward are answered together."""
    b, g, t, o, i = parts[0].dims
    a = torch.stack([p.a for p in parts]).reshape(-1, t, i)  # (n*B*G, T, I)
    s = torch.stack([p.s for p in parts]).reshape(-1, t, o)  # (n*B*G, T, O)
    grams = (a @ a.mT) * (s @ s.mT)  # (n*B*G, T, T)
    return grams.sum((1, 2)).reshape(len(parts), b, g).sum(2)


def gram_norm_sq(s: Tensor, a: Tensor) -> Tensor:
    """(B,) sum_{t,t'} (a_t . a_t')(s_t . s_t') of one call, s (B, G, T, O), a (B, G, T, I): in
    (c, c) blocks so that no (T, T) matrix is needed."""
    b, g, t, _ = s.shape
    c = max(1, min(t, int((CHUNK_ELEMENTS / (b * g)) ** 0.5)))
    if c == t:  # one block: its sum, with no running total
        gram_a, gram_s = a @ a.mT, s @ s.mT  # (B, G, T, T) each
        return (gram_a * gram_s).sum((1, 2, 3))
    total = s.new_zeros(b)
    for lo in range(0, t, c):
        a_lo, s_lo = a[:, :, lo : lo + c], s[:, :, lo : lo + c]
        for hi in range(lo, t, c):
            a_hi, s_hi = a[:, :, hi : hi + c], s[:, :, hi : hi + c]
            block = (a_lo @ a_hi.mT) * (s_lo @ s_hi.mT)  # (B, G, c, c)
            total += block.sum((1, 2, 3)) * (1 if hi == lo else 2)  # off-diagonal blocks twice
    return total
