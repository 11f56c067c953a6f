"""K-FAC and EK-FAC factors from the engine's factored per-example gradients (the file: store.py).

Definitions (N examples, G_i example i's gradient of one parameter, F = E_i[vec G_i vec G_i^T]):

- A weight served as ``Outer(s, a)`` (Linear, Conv unfolded, HF Conv1D; G_i = sum_t s_t a_t^T per
  group) gets K-FAC factors per group: ``A = (1/N) sum_i sum_t a_it a_it^T`` (positions summed,
  examples averaged) and ``S = (1/M) sum_i sum_t s_it s_it^T`` (M counted positions): then
  ``S (x) A`` approximates F, positions taken as independent. Positions that add nothing to any
  gradient (a zero input or a zero output gradient: padding, a causal LM's last position) are
  not counted. kronfluence averages both over positions; its ``S (x) A`` is ours divided by the
  mean number of positions per example, which the relative damping below turns into a constant
  factor on every score. For HF Conv1D's (in, out) weight the Outer holds the input in ``s``'s
  slot: factors are named by slot, the math is the same.
- EK-FAC (``--ekfac``): a second pass for the eigenvalues in the Kronecker eigenbasis,
  ``Lambda[o, i] = (1/N) sum_i (Q_S^T G_i Q_A)[o, i]^2``, as kronfluence's lambda matrix.
- A parameter of at most ``FULL_ELEMENTS`` numbers, however a rule serves it (a bias, a norm's
  scale, a classifier's small head), gets its whole Fisher block instead, ``F = (1/N) sum_i
  vec G_i vec G_i^T``, and its eigendecomposition: exact for that parameter, where the
  Kronecker product takes positions and factors as independent and the diagonal drops every
  correlation (on the digits MLP's ensemble over epoch checkpoints, EK-FAC's LDS 0.44 -> 0.47
  -> 0.49 with whole blocks for the biases, then for the 64 x 10 head too).
- Every other parameter (embeddings, tied weights, large formed ones) gets the Fisher's diagonal
  ``(1/N) sum_i G_i^2``.

Damping, per parameter, 0.1 x the mean eigenvalue (kronfluence's heuristic) of what it damps:
K-FAC damps each factor, ``(S + d_S I) (x) (A + d_A I)``, so its inverse and square root factor
into per-factor matrices (the ghost norm of whitened tensors); EK-FAC damps the eigenvalues,
``Q diag(Lambda + d) Q^T`` as kronfluence does; a full block its eigenvalues, ``Q (E + d) Q^T``;
the diagonal ``diag(F + d)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..defaults import KRONFLUENCE
from ..errors import GradscopeError, ModelError
from ..rules import Contribution, Dense, Outer, Rows
from ..rules.base import CHUNK_ELEMENTS
from ..rules.embedding import example_keys
from .finite import Parts, finite_parts

KFAC, EKFAC, DIAGONAL, FULL = "kfac", "ekfac", "diagonal", "full"
FULL_ELEMENTS = 1024  # a parameter up to this size: its whole block, 2 x 8 MiB float64
Batches = Iterable[tuple[tuple[Tensor, ...], Tensor]]


def damping(values: Tensor, factor: float = KRONFLUENCE) -> float:
    """``factor`` (0.1) x the mean of ``values`` (eigenvalues); 1 where they are all zero (an
    unused layer)."""
    mean = values.double().mean().item()
    return factor * mean if mean > 0 else 1.0


@dataclass
class Block:
    """One parameter's curvature: K-FAC factors per group (and EK-FAC's eigenvalues), its whole
    block, or a diagonal. Tensors in float64."""

    kind: str  # KFAC, FULL or DIAGONAL
    shape: torch.Size
    tensors: dict[str, Tensor] = field(default_factory=dict)
    damping: dict[str, float] = field(default_factory=dict)

    @property
    def ekfac(self) -> bool:
        return "lambda" in self.tensors

    def describe(self) -> dict:
        out = {"kind": EKFAC if self.ekfac else self.kind, "shape": list(self.shape)}
        if self.kind == KFAC:
            out["groups"] = self.tensors["A"].shape[0]
        return out | {"damping": self.damping}


@contextlib.contextmanager
def factored_convs() -> Iterator[None]:
    """For the factors pass: every Conv weight as ``Outer`` of its unfolded input, also where
    the conv rule forms per-example gradients instead (many positions), so that it gets K-FAC
    factors. The registered rules are restored on exit; scoring needs no change (the K-FAC
    transform of formed gradients is exact, only dearer)."""
    from ..rules import RULES
    from ..rules.conv import unfold

    convs = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    saved = {t: RULES[t] for t in convs}

    def rule(module, inputs, grad_output, **kwargs):
        parts = saved[type(module)].fn(module, inputs, grad_output, **kwargs)
        if isinstance(parts.get("weight"), Dense):
            b, g = grad_output.shape[0], module.groups
            t, o = math.prod(grad_output.shape[2:]), module.out_channels // g
            s = grad_output.reshape(b, g, o, t).transpose(-1, -2)  # (B, G, T, out/G)
            parts["weight"] = Outer(s, unfold(module, inputs[0]), module.weight.shape)
        return parts

    try:
        for t in convs:
            RULES[t] = dataclasses.replace(saved[t], fn=rule)
        yield
    finally:
        RULES.update(saved)


def times(x: Tensor, m: Tensor) -> Tensor:
    """(B, G, T, D) @ (G, D, E) per group: one matrix product when there is one group."""
    if m.shape[0] == 1:
        return (x.reshape(-1, x.shape[-1]) @ m[0]).view(*x.shape[:-1], m.shape[-1])
    return torch.einsum("bgtd,gde->bgte", x, m)


def _row_squares(rows: Rows) -> Tensor:
    """(V, D) sum over examples of each example's squared table gradient, never (B, V, D)."""
    v, d = rows.shape
    keys, inverse = torch.unique(example_keys(rows.ids, v), return_inverse=True)
    per_row = rows.s.new_zeros(keys.shape[0], d).index_add_(0, inverse, rows.s.reshape(-1, d))
    return rows.s.new_zeros(v, d).index_add_(0, keys % v, per_row.square())


def grouped(c: Contribution, g: int, o: int, i: int) -> Tensor:
    """(B, G, O, I) per-example gradients of a K-FAC parameter not served as an Outer."""
    return c.materialize().reshape(-1, g, o, i)


class Accumulator:
    """Sums over the batches of one pass: covariances, the diagonal, EK-FAC's eigenvalues."""

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}
        self.shapes: dict[str, torch.Size] = {}
        self.sums: dict[str, dict[str, Tensor]] = {}
        self.examples = 0

    def _add(self, name: str, key: str, value: Tensor) -> None:
        sums = self.sums.setdefault(name, {})
        value = value.detach().to("cpu", torch.float64)  # small: (G, D, D), (G, O, I), a diagonal
        sums[key] = value if key not in sums else sums[key] + value

    def _kind(self, name: str, c: Contribution) -> str:
        if math.prod(c.shape) <= FULL_ELEMENTS:
            kind = FULL
        else:
            kind = KFAC if isinstance(c, Outer) else DIAGONAL
        known = self.kinds.setdefault(name, kind)
        self.shapes.setdefault(name, c.shape)
        if known == KFAC and kind != KFAC:
            raise ModelError(
                f"parameter {name} was served as a product of inputs and output gradients on "
                f"the first batch and not on a later one; exclude it or give all batches one shape",
                "params",
            )
        return known

    def covariances(self, parts: dict[str, Contribution | None], batch: int) -> None:
        """The first pass: the whole block of a small parameter, A and S of each other Outer
        one, the diagonal of the rest."""
        self.examples += batch
        for name, c in parts.items():
            if c is None:
                continue
            kind = self._kind(name, c)
            if kind == FULL:
                g = c.materialize().flatten(1)  # (B, D), positions summed
                self._add(name, "F", g.T @ g)  # (D, D)
            elif kind == KFAC:
                s, a = c.s, c.a  # (B, G, T, O), (B, G, T, I)
                counted = ((s != 0).any(-1) & (a != 0).any(-1)).to(s.dtype)  # (B, G, T)
                am = a * counted[..., None]
                self._add(name, "A", torch.einsum("bgti,bgtj->gij", am, a))  # (G, I, I)
                self._add(name, "S", torch.einsum("bgto,bgtp->gop", s * counted[..., None], s))
                self._add(name, "positions", counted.sum((0, 2)))  # (G,)
            elif isinstance(c, Dense):
                self._add(name, "diagonal", c.grads.square().sum(0))
            elif isinstance(c, Rows):
                self._add(name, "diagonal", _row_squares(c))
            else:
                self._add(name, "diagonal", c.materialize().square().sum(0))

    def eigenvalues(
        self, parts: dict[str, Contribution | None], batch: int, blocks: dict[str, Block]
    ) -> None:
        """EK-FAC's pass: each example's gradient in the Kronecker eigenbasis, squared."""
        self.examples += batch
        for name, c in parts.items():
            if c is None or blocks[name].kind != KFAC:
                continue
            block = blocks[name]
            q_s, q_a = block.tensors["S_eigenvectors"], block.tensors["A_eigenvectors"]
            if isinstance(c, Outer):
                s = times(c.s, q_s.to(c.s.device, c.s.dtype))  # Q_S^T s_t
                a = times(c.a, q_a.to(c.a.device, c.a.dtype))  # Q_A^T a_t
                b, g, t, o = s.shape
                if t == 1:  # rank one: sum_i s_o^2 a_i^2, one product, nothing formed
                    sq_s, sq_a = s[:, :, 0].square(), a[:, :, 0].square()  # (B, G, O), (B, G, I)
                    self._add(name, "lambda", sq_s.permute(1, 2, 0) @ sq_a.transpose(0, 1))
                    continue
                step = max(1, CHUNK_ELEMENTS // (g * o * a.shape[-1]))
                for lo in range(0, b, step):
                    # (b, G, O, T) @ (b, G, T, I): rotated per-example gradients, a few at a time
                    rotated = s[lo : lo + step].transpose(-1, -2) @ a[lo : lo + step]
                    self._add(name, "lambda", rotated.square().sum(0))
            else:
                g = grouped(c, *q_s.shape[:2], q_a.shape[-1]).to("cpu", q_s.dtype)
                rotated = q_s.transpose(-1, -2) @ g @ q_a  # (B, G, O, I)
                self._add(name, "lambda", rotated.square().sum(0))


def blocks_from(acc: Accumulator) -> dict[str, Block]:
    """Normalised covariances, their eigendecompositions and dampings."""
    blocks = {}
    for name, kind in acc.kinds.items():
        sums, n = acc.sums[name], max(acc.examples, 1)
        block = Block(kind, acc.shapes[name])
        if kind == KFAC:
            positions = sums["positions"].clamp_min(1)
            covariances = {"A": sums["A"] / n, "S": sums["S"] / positions[:, None, None]}
        elif kind == FULL:
            covariances = {"F": sums["F"] / n}
        if kind in (KFAC, FULL):
            for key, cov in covariances.items():
                values, vectors = torch.linalg.eigh(cov)  # (G, D), (G, D, D) or (D,), (D, D)
                values = values.clamp_min(0)  # round-off below zero
                block.tensors |= {
                    key: cov,
                    f"{key}_eigenvalues": values,
                    f"{key}_eigenvectors": vectors,
                }
                block.damping[key] = damping(values)
        else:
            block.tensors["diagonal"] = sums["diagonal"] / n
            block.damping["diagonal"] = damping(block.tensors["diagonal"])
        blocks[name] = block
    return blocks


def add_eigenvalues(acc: Accumulator, blocks: dict[str, Block]) -> None:
    for name, block in blocks.items():
        if block.kind == KFAC and "lambda" in acc.sums.get(name, {}):
            block.tensors["lambda"] = acc.sums[name]["lambda"] / max(acc.examples, 1)
            block.damping["lambda"] = damping(block.tensors["lambda"])


def fit(
    contributions: Callable[[tuple[Tensor, ...], Tensor], tuple[Tensor, Parts]],
    batches: Callable[[], Batches],
    *,
    ekfac: bool = False,
    draw: Callable[[int, tuple[Tensor, ...], Tensor], Tensor] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[dict[str, Block], int, int]:
    """The blocks from one pass over ``batches()`` (two with ``ekfac``), the examples they hold,
    and how many were left out for a NaN or infinite loss or gradient.

    ``contributions(inputs, targets)`` gives the per-example losses and each parameter's
    factored per-example gradients; ``draw(seed, inputs, targets)``, the targets it takes
    instead of batch k's (the true Fisher's labels, drawn with seed k: the eigenvalue pass
    draws afresh, as kronfluence's does).
    """
    acc, left = Accumulator(), 0
    for k, (inputs, targets) in enumerate(batches()):
        if draw:
            targets = draw(k, inputs, targets)
        parts, bad = finite_parts(*contributions(inputs, targets))
        acc.covariances(parts, targets.shape[0] - bad)
        left += bad
        if on_batch:
            on_batch(targets.shape[0])
    if not acc.examples:
        what = "every example has a NaN or infinite loss or gradient" if left else "no examples"
        raise GradscopeError(f"{what}: no factors to compute", "data")
    blocks = blocks_from(acc)
    if ekfac:
        second = Accumulator()
        for k, (inputs, targets) in enumerate(batches()):
            if draw:
                targets = draw(1_000_003 + k, inputs, targets)
            parts, bad = finite_parts(*contributions(inputs, targets))
            second.eigenvalues(parts, targets.shape[0] - bad, blocks)
            if on_batch:
                on_batch(targets.shape[0])
        add_eigenvalues(second, blocks)
    return blocks, acc.examples, left


def redamp(blocks: dict[str, Block], factor: float) -> None:
    """Each block damped with ``factor`` x the mean eigenvalue of what it damps, in place."""
    for block in blocks.values():
        for key in block.damping:
            values = block.tensors[key if key in ("diagonal", "lambda") else f"{key}_eigenvalues"]
            block.damping[key] = damping(values, factor)
