"""Preconditioners for influence and norms: Adam's second moment, or K-FAC / EK-FAC factors.

A preconditioner P acts twice. ``refs`` maps reference directions R to P R once, so the existing
pass computes ``<G_i, P R>`` exactly at today's cost. ``transform`` maps a contribution G_i to
one whose squared norm is ``g_i^T P g_i`` (P's square root applied to G_i):

- K-FAC: ``Outer(s W_S, a W_A)`` with ``W = (X + d)^-1/2``: the whitened ghost norm, no
  per-example gradient formed;
- EK-FAC (its damping does not factor): the per-example gradients in the Kronecker eigenbasis,
  ``Q_S^T G_i Q_A`` from the rotated Outer, weighted by ``(Lambda + d)^-1/2``; formed a few
  examples at a time, ``B T O I`` multiply-adds per layer (one more forward's worth);
- a diagonal (Adam's ``1 / (sqrt(v_hat) + eps)``, the Fisher's ``1 / (F + d)``): each element
  weighted by the square root; Dense and Rows stay as they are, an Outer is formed in chunks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import ModelError
from ..rules import Contribution, Dense, Outer, Rows
from ..rules.base import CHUNK_ELEMENTS, rows
from .factors import DIAGONAL, Block, Factors, is_factors_file, times


class Weighted(Contribution):
    """``G_i * w`` elementwise for an Outer ``G_i`` and ``w`` of the parameter's (G, O, I) layout:
    the per-example gradients formed a few examples at a time, never all at once."""

    def __init__(self, outer: Outer, weight: Tensor):
        self.outer, self.shape = outer, outer.shape
        self.weight = weight.to(outer.s.dtype).reshape(*outer.dims[1:2], *outer.dims[3:])

    def _chunks(self):
        b, g, _, o, i = self.outer.dims
        step = max(1, CHUNK_ELEMENTS // (g * o * i))
        for lo in range(0, b, step):
            s, a = self.outer.s[lo : lo + step], self.outer.a[lo : lo + step]
            yield (s.transpose(-1, -2) @ a) * self.weight  # (b, G, O, T) @ (b, G, T, I)

    def norm_sq(self) -> Tensor:
        if self.outer.dims[2] == 1:
            # one position: sum_oi w_oi^2 s_o^2 a_i^2, a product with w^2, nothing formed
            s, a = self.outer.s[:, :, 0], self.outer.a[:, :, 0]  # (B, G, O), (B, G, I)
            sw = (s.square().transpose(0, 1) @ self.weight.square()).transpose(0, 1)  # (B, G, I)
            return (sw * a.square()).sum((1, 2))
        return torch.cat([m.flatten(1).square().sum(1) for m in self._chunks()])

    def inner(self, refs: Tensor) -> Tensor:
        r = rows(refs.to(self.weight.dtype))  # (K, P)
        return torch.cat([m.flatten(1) @ r.T for m in self._chunks()])  # (b, P) @ (P, K)

    def materialize(self) -> Tensor:
        return torch.cat(list(self._chunks())).reshape(-1, *self.shape)


def _weighted(c: Contribution, w: Tensor) -> Contribution:
    """``G_i * w`` elementwise, ``w`` of the parameter's shape, in the cheapest form at hand."""
    if isinstance(c, Dense):
        return Dense(c.grads * w.to(c.grads.dtype))
    if isinstance(c, Rows):  # example i's row v is a sum of s_t over the positions looking up v
        return Rows(c.ids, c.s * w.to(c.s.dtype)[c.ids], c.shape[0])
    if isinstance(c, Outer):
        return Weighted(c, w)
    return Dense(c.materialize() * w)


class Diagonal:
    """P = diag(1 / denominator), per parameter."""

    def __init__(self, denominators: dict[str, Tensor], kind: str):
        self.denominators, self.kind = denominators, kind
        self._roots = {n: d.double().rsqrt() for n, d in denominators.items()}

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: r / self.denominators[n].to(r.dtype) for n, r in refs.items()}

    def transform(self, name: str, c: Contribution) -> Contribution:
        return _weighted(c, self._roots[name])

    def describe(self) -> dict:
        return {"kind": self.kind}


def _power(block: Block, key: str, power: float, dtype: torch.dtype) -> Tensor:
    """(G, D, D) ``(X + d I)^power`` of factor ``key`` from its eigendecomposition."""
    values = block.tensors[f"{key}_eigenvalues"] + block.damping[key]  # (G, D)
    vectors = block.tensors[f"{key}_eigenvectors"]  # (G, D, D)
    return ((vectors * values.pow(power)[:, None, :]) @ vectors.transpose(-1, -2)).to(dtype)


class Curvature:
    """P = the inverse of each parameter's damped K-FAC / EK-FAC block or diagonal."""

    def __init__(self, factors: Factors):
        self.factors = factors
        self.kind = factors.method
        self._cache: dict[tuple, Tensor] = {}

    def _cached(self, name: str, what: str, dtype: torch.dtype) -> Tensor:
        key = (name, what, dtype)
        if key not in self._cache:
            block = self.factors.blocks[name]
            t = block.tensors
            if what in ("A", "S"):  # K-FAC whitening
                value = _power(block, what, -0.5, dtype)
            elif what in ("A_inverse", "S_inverse"):
                value = _power(block, what[0], -1.0, dtype)
            elif what == "lambda_root":  # (G, O, I)
                value = (t["lambda"] + block.damping["lambda"]).rsqrt().to(dtype)
            elif what == "diagonal_root":
                value = (t["diagonal"] + block.damping["diagonal"]).rsqrt().to(dtype)
            else:  # eigenvectors
                value = t[what].to(dtype)
            self._cache[key] = value
        return self._cache[key]

    def _grouped(self, name: str, g: Tensor) -> Tensor:
        """(K, *shape) -> (K, G, O, I) in the block's layout."""
        t = self.factors.blocks[name].tensors
        return g.reshape(g.shape[0], t["S"].shape[0], t["S"].shape[-1], t["A"].shape[-1])

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``P R`` per parameter: ``(S+d)^-1 R (A+d)^-1`` (K-FAC), in the eigenbasis divided by
        ``Lambda + d`` (EK-FAC), or ``R / (F + d)`` (diagonal)."""
        out = {}
        for name, r in refs.items():
            block, dtype = self.factors.blocks[name], torch.float64
            if block.kind == DIAGONAL:
                d = block.tensors["diagonal"] + block.damping["diagonal"]
                out[name] = (r.double() / d).to(r.dtype)
                continue
            g = self._grouped(name, r.double())  # (K, G, O, I)
            if block.ekfac:
                q_s = self._cached(name, "S_eigenvectors", dtype)
                q_a = self._cached(name, "A_eigenvectors", dtype)
                rotated = q_s.transpose(-1, -2) @ g @ q_a
                rotated = rotated / (block.tensors["lambda"] + block.damping["lambda"])
                g = q_s @ rotated @ q_a.transpose(-1, -2)
            else:
                g = (
                    self._cached(name, "S_inverse", dtype)
                    @ g
                    @ self._cached(name, "A_inverse", dtype)
                )
            out[name] = g.reshape(r.shape).to(r.dtype)
        return out

    def transform(self, name: str, c: Contribution) -> Contribution:
        """A contribution whose squared norm is ``g_i^T P g_i``."""
        block = self.factors.blocks[name]
        if block.kind == DIAGONAL:
            dtype = c.s.dtype if isinstance(c, Outer | Rows) else torch.float64
            return _weighted(c, self._cached(name, "diagonal_root", dtype))
        if block.ekfac:
            if isinstance(c, Outer):
                dtype = c.s.dtype
                q_s = self._cached(name, "S_eigenvectors", dtype)
                q_a = self._cached(name, "A_eigenvectors", dtype)
                s, a = times(c.s, q_s), times(c.a, q_a)  # Q_S^T s_t, Q_A^T a_t
                return Weighted(Outer(s, a, c.shape), self._cached(name, "lambda_root", dtype))
            g = self._grouped(name, c.materialize().double())
            q_s = self._cached(name, "S_eigenvectors", torch.float64)
            q_a = self._cached(name, "A_eigenvectors", torch.float64)
            rotated = (q_s.transpose(-1, -2) @ g @ q_a) * self._cached(
                name, "lambda_root", torch.float64
            )
            return Dense(rotated.reshape(-1, *c.shape))
        if isinstance(c, Outer):  # K-FAC: (S+d)^-1/2 s_t and (A+d)^-1/2 a_t, both symmetric
            dtype = c.s.dtype
            s = times(c.s, self._cached(name, "S", dtype))
            a = times(c.a, self._cached(name, "A", dtype))
            return Outer(s, a, c.shape)
        g = self._grouped(name, c.materialize().double())
        g = self._cached(name, "S", torch.float64) @ g @ self._cached(name, "A", torch.float64)
        return Dense(g.reshape(-1, *c.shape))

    def describe(self) -> dict:
        """The method, the Fisher, and per parameter its block: kfac, ekfac or diagonal."""
        return {
            "kind": self.kind,
            "fisher": self.factors.meta.get("fisher"),
            "parameters": {n: b["kind"] for n, b in self.factors.describe().items()},
        }


Preconditioner = Diagonal | Curvature


def check_fits(factors: Factors, engine, where: str) -> None:
    """The selected parameters must be the factors' own, with the same shapes."""
    want = {p.name: list(p.param.shape) for p in engine.plan.included}
    have = {n: list(b.shape) for n, b in factors.blocks.items()}
    if want != have:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        shapes = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        what = "; ".join(
            f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
            for label, names in (("not in the factors", missing), ("only in the factors", extra),
                                 ("other shapes", shapes))
            if names
        )  # fmt: skip
        raise ModelError(f"the factors do not fit the selected parameters ({what})", where)


def load_preconditioner(
    path: str | Path, engine, checkpoint_sha256: str | None = None
) -> Preconditioner:
    """A factors file (``gradscope factors``) or an Adam/AdamW ``state_dict()``, told apart by
    their content. Factors must fit the engine's selected parameters, and come from the same
    checkpoint when ``checkpoint_sha256`` is given."""
    from ..engine.influence import adam_denominator
    from ..io.model import load_state_dict

    where = str(path)
    if is_factors_file(path):
        factors = Factors.load(path)
        check_fits(factors, engine, where)
        made = factors.meta.get("model", {}).get("checkpoint_sha256")
        if checkpoint_sha256 and made and made != checkpoint_sha256:
            raise ModelError(
                "the factors were computed at another checkpoint (its sha256 differs); run "
                "gradscope factors on this config again",
                where,
            )
        return Curvature(factors)
    hint = "; save optimizer.state_dict() itself, which holds only tensors and numbers"
    state = load_state_dict(path, hint=hint)
    return Diagonal(adam_denominator(state, engine, where), "adam")
