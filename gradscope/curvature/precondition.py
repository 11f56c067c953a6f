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
  weighted by the square root; Dense and Rows stay as they are, an Outer is formed in chunks;
- a full block ``Q (E + d) Q^T`` (a small parameter): ``G_i Q (E + d)^-1/2``, formed, rotated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import ModelError
from ..rules import Contribution, Dense, Outer, Rows
from ..rules.base import CHUNK_ELEMENTS, accumulation_dtype, rows
from ..rules.factored import Factored, Reference, dense
from .adam import adam_denominator
from .factors import DIAGONAL, FULL, Block, times
from .made import check_made
from .store import Factors, is_factors_file


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
        self._roots = {
            n: d.to(accumulation_dtype(d.dtype)).rsqrt() for n, d in denominators.items()
        }

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: r / self.denominators[n].to(r.dtype) for n, r in refs.items()}

    def transform(self, name: str, c: Contribution) -> Contribution:
        return _weighted(c, self._roots[name])

    def describe(self) -> dict:
        return {"kind": self.kind}


def _power(block: Block, key: str, power: float) -> Tensor:
    """(G, D, D) ``(X + d I)^power`` of factor ``key`` from its eigendecomposition."""
    values = block.tensors[f"{key}_eigenvalues"] + block.damping[key]  # (G, D)
    vectors = block.tensors[f"{key}_eigenvectors"]  # (G, D, D)
    return (vectors * values.pow(power)[:, None, :]) @ vectors.transpose(-1, -2)


def _kronecker(block: Block, r: Factored) -> bool:
    """Whether ``block`` is a K-FAC one (not EK-FAC, whose damping does not factor) of the
    groups, outputs and inputs ``r``'s factors hold."""
    if block.kind in (DIAGONAL, FULL) or block.ekfac:
        return False
    s, a = block.tensors["S"], block.tensors["A"]  # (G, O, O), (G, I, I)
    return (s.shape[0], s.shape[-1], a.shape[-1]) == (r.u.shape[1], r.u.shape[-1], r.v.shape[-1])


def _factored(block: Block, r: Factored) -> Factored:
    """``(S+d)^-1 R (A+d)^-1`` of a factored R = sum_n u_n v_n^T: sum_n (S+d)^-1 u_n
    ((A+d)^-1 v_n)^T, factored still; on the CPU in float64, as ``refs`` forms it."""
    u = r.u.detach().to("cpu", torch.float64) @ _power(block, "S", -1.0).mT  # (K, G, N, O)
    v = r.v.detach().to("cpu", torch.float64) @ _power(block, "A", -1.0)  # (K, G, N, I)
    return Factored(u.to(r.u.device, r.u.dtype), v.to(r.v.device, r.v.dtype), r.param_shape)


class Curvature:
    """P = the inverse of each parameter's damped K-FAC / EK-FAC block or diagonal."""

    def __init__(self, factors: Factors):
        self.factors = factors
        self.kind = factors.method
        self._cache: dict[tuple, Tensor] = {}

    def _cached(self, name: str, what: str, like: Tensor) -> Tensor:
        """A matrix or weight of the block, computed on the CPU in float64 and kept on the
        device and in the dtype of ``like``."""
        key = (name, what, like.dtype, like.device)
        if key not in self._cache:
            block = self.factors.blocks[name]
            t = block.tensors
            if what in ("A", "S"):  # K-FAC whitening
                value = _power(block, what, -0.5)
            elif what == "lambda_root":  # (G, O, I)
                value = (t["lambda"] + block.damping["lambda"]).rsqrt()
            elif what == "diagonal_root":
                value = (t["diagonal"] + block.damping["diagonal"]).rsqrt()
            elif what == "full_root":  # (D, D): Q (E + d)^-1/2, columns weighted
                value = t["F_eigenvectors"] * (t["F_eigenvalues"] + block.damping["F"]).rsqrt()
            else:  # eigenvectors
                value = t[what]
            self._cache[key] = value.to(like.device, like.dtype)
        return self._cache[key]

    def _grouped(self, name: str, g: Tensor) -> Tensor:
        """(K, *shape) -> (K, G, O, I) in the block's layout."""
        t = self.factors.blocks[name].tensors
        return g.reshape(g.shape[0], t["S"].shape[0], t["S"].shape[-1], t["A"].shape[-1])

    def refs(self, refs: dict[str, Reference]) -> dict[str, Reference]:
        """``P R`` per parameter: ``(S+d)^-1 R (A+d)^-1`` (K-FAC; a factored R stays factored,
        ``_factored``), in the eigenbasis divided by ``Lambda + d`` (EK-FAC) or ``E + d`` (a
        full block), or ``R / (F + d)`` (diagonal); once, on the CPU in float64."""
        out = {}
        for name, r in refs.items():
            block, t = self.factors.blocks[name], self.factors.blocks[name].tensors
            if isinstance(r, Factored) and _kronecker(block, r):
                out[name] = _factored(block, r)
                continue
            r = dense(r)
            g = r.detach().to("cpu", torch.float64)
            if block.kind == DIAGONAL:
                g = g / (t["diagonal"] + block.damping["diagonal"])
            elif block.kind == FULL:
                q = t["F_eigenvectors"]  # (D, D)
                rotated = g.flatten(1) @ q / (t["F_eigenvalues"] + block.damping["F"])  # (K, D)
                g = rotated @ q.T
            elif block.ekfac:
                q_s, q_a = t["S_eigenvectors"], t["A_eigenvectors"]
                rotated = q_s.transpose(-1, -2) @ self._grouped(name, g) @ q_a  # (K, G, O, I)
                rotated = rotated / (t["lambda"] + block.damping["lambda"])
                g = q_s @ rotated @ q_a.transpose(-1, -2)
            else:
                g = _power(block, "S", -1.0) @ self._grouped(name, g) @ _power(block, "A", -1.0)
            out[name] = g.reshape(r.shape).to(r.device, r.dtype)
        return out

    def transform(self, name: str, c: Contribution) -> Contribution:
        """A contribution whose squared norm is ``g_i^T P g_i``."""
        block = self.factors.blocks[name]
        like = c.s if isinstance(c, Outer | Rows) else c.materialize()
        if block.kind == DIAGONAL:
            return _weighted(c, self._cached(name, "diagonal_root", like))
        if block.kind == FULL:  # linear, so a part at a time; the rotation keeps the norm
            g = c.materialize()  # (B, *shape)
            return Dense((g.flatten(1) @ self._cached(name, "full_root", g)).reshape(g.shape))
        q_s, q_a = (self._cached(name, f"{k}_eigenvectors", like) for k in ("S", "A"))
        if block.ekfac and isinstance(c, Outer):
            s, a = times(c.s, q_s), times(c.a, q_a)  # Q_S^T s_t, Q_A^T a_t
            return Weighted(
                Outer(s, a, c.shape, c.lengths), self._cached(name, "lambda_root", like)
            )
        if block.ekfac:  # a K-FAC parameter served otherwise (the fallback): rotate, weigh
            g = q_s.transpose(-1, -2) @ self._grouped(name, like) @ q_a
            return Dense((g * self._cached(name, "lambda_root", like)).reshape(-1, *c.shape))
        w_s, w_a = self._cached(name, "S", like), self._cached(name, "A", like)
        if isinstance(c, Outer):  # K-FAC: (S+d)^-1/2 s_t and (A+d)^-1/2 a_t, both symmetric
            return Outer(times(c.s, w_s), times(c.a, w_a), c.shape, c.lengths)
        return Dense((w_s @ self._grouped(name, like) @ w_a).reshape(-1, *c.shape))

    def describe(self) -> dict:
        """The method, the Fisher, the dtype the factors were fitted in, and per parameter its
        block: kfac, ekfac or diagonal."""
        made = self.factors.meta.get("model")
        return {
            "kind": self.kind,
            "fisher": self.factors.meta.get("fisher"),
            "fitted_in": made.get("dtype") if isinstance(made, dict) else None,
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


def load_preconditioner(path: str | Path, engine, model: dict | None = None) -> Preconditioner:
    """A factors file (``gradscope factors``) or an Adam/AdamW ``state_dict()``, told apart by
    their content. Factors must fit the engine's selected parameters, and, unless ``model`` is
    None, come from the model that ``model`` (a run's metadata, or {}) describes (``made.py``)."""
    from ..io.files import load_state_dict

    where = str(path)
    if is_factors_file(path):
        factors = Factors.load(path)
        check_fits(factors, engine, where)
        if model is not None:
            check_made(factors, model, engine, where)
        return Curvature(factors)
    hint = "; save optimizer.state_dict() itself, which holds only tensors and numbers"
    state = load_state_dict(path, hint=hint, what="--precondition file")
    return Diagonal(adam_denominator(state, engine, where), "adam")
