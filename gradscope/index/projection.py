"""The index's projections: which matrix each parameter is read as, how many dimensions each side
keeps, and the seeded Gaussian factors, rebuilt alike wherever the index is queried.

Each selected parameter is one block of an index row. A weight is read as a matrix: a conv's
as (out, in * kernel), any other of 3+ dims as (all but the last dim, the last) (a fused expert
weight's experts stacked as rows), a 2-D one as it is, a vector as one row. The block keeps
``k_out * k_in <= dim`` numbers (a vector ``isqrt(dim)``); a side no larger than what it keeps is
kept whole (no projection, exact), so a small parameter's block is its gradient itself.
The factors have i.i.d. N(0, 1/k) entries, so that ``E[phi_i . phi_j] = <g_i, g_j>``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..engine import ParamPlan, Plan
from ..errors import DataError
from ..rules.projection import Projection, as_matrix

DEFAULT_DIM = 1024
RNG = (
    "torch.randn(rows, k, generator=torch.Generator('cpu').manual_seed(s), dtype=float32) / sqrt(k)"
)


@dataclass(frozen=True)
class Block:
    """One parameter's columns ``start .. start + k_out * k_in`` of an index row."""

    name: str
    shape: tuple[int, ...]
    split: int  # the leading dims that are the matrix's rows
    k_out: int
    k_in: int
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.k_out * self.k_in


def split_of(p: ParamPlan) -> int:
    """How many leading dims of ``p`` are rows: those of the matrix its rule's factors make."""
    ndim = p.param.dim()
    if ndim < 2:
        return 0
    if ndim == 2 or any(isinstance(m, nn.modules.conv._ConvNd) for m, _ in p.owners):
        return 1
    return ndim - 1


def sides(rows: int, cols: int, dim: int) -> tuple[int, int]:
    """(k_out, k_in): near a square of ``dim`` numbers, each side at most its size; one row (a
    vector) keeps one side's share, ``isqrt(dim)``."""
    side = max(1, math.isqrt(dim))
    if rows == 1:
        return 1, min(cols, side)
    k_out = min(rows, side)
    k_in = min(cols, max(1, dim // k_out))
    return min(rows, max(1, dim // k_in)), k_in


def blocks(plan: Plan, dim: int) -> list[Block]:
    """The blocks of an index row, one per selected parameter, in the plan's order."""
    out, start = [], 0
    for p in plan.included:
        shape, split = tuple(p.param.shape), split_of(p)
        k_out, k_in = sides(*as_matrix(shape, split), dim)
        out.append(Block(p.name, shape, split, k_out, k_in, start))
        start = out[-1].stop
    return out


def factor(seed: int, name: str, side: str, n: int, k: int) -> Tensor | None:
    """(n, k) N(0, 1/k) entries drawn on the CPU in float32 from a seed of (seed, name, side);
    None where the side is kept whole (k == n)."""
    if k == n:
        return None
    digest = hashlib.sha256(f"{seed}/{name}/{side}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(n, k, generator=generator) / math.sqrt(k)


class Projector:
    """Every block's projection on ``device``, and the index rows they make."""

    def __init__(self, blocks: list[Block], seed: int, device: torch.device, dtype: torch.dtype):
        self.blocks, self.seed = blocks, seed
        self.width = blocks[-1].stop if blocks else 0

        def made(b: Block, side: str, n: int, k: int) -> Tensor | None:
            f = factor(seed, b.name, side, n, k)
            return None if f is None else f.to(device, dtype)

        self.projections = {}
        for b in blocks:
            rows, cols = as_matrix(b.shape, b.split)
            out, inn = made(b, "out", rows, b.k_out), made(b, "in", cols, b.k_in)
            self.projections[b.name] = Projection(torch.Size(b.shape), b.split, out, inn)

    def rows(self, per_param: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        """{name: (B, block dim)} -> (B, width), the blocks side by side (into ``out``)."""
        return torch.cat([per_param[b.name] for b in self.blocks], 1, out=out)

    def dense(self, grads: dict[str, Tensor]) -> Tensor:
        """{name: (K, *shape)} formed gradients (references) -> (K, width)."""
        return self.rows({n: p.dense(grads[n]) for n, p in self.projections.items()})

    def describe(self) -> dict:
        return {
            "kind": "kronecker-gaussian",
            "seed": self.seed,
            "rng": RNG,
            "width": self.width,
            "blocks": [asdict(b) for b in self.blocks],
        }

    @classmethod
    def of(cls, described: dict, plan: Plan, device: torch.device, dtype: torch.dtype) -> Projector:
        """The projector an index describes, for a model whose ``plan`` must select the same
        parameters, of the same shapes."""
        made = [Block(**{**b, "shape": tuple(b["shape"])}) for b in described["blocks"]]
        have = [(p.name, tuple(p.param.shape)) for p in plan.included]
        if have != [(b.name, b.shape) for b in made]:
            raise DataError(
                "the index holds other parameters than the model selects now "
                f"({len(made)} indexed, {len(have)} selected); use the index's config",
                "INDEX",
            )
        return cls(made, described["seed"], device, dtype)
