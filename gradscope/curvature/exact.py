"""The exact damped inverse of the Gauss-Newton matrix or the Hessian, dense: the P x P matrix
over the data (``products.py``), eigendecomposed once, so that each damping is one product.

``P = (C + lambda I)^-1 = V diag(1 / (w + lambda)) V^T`` with ``C = V diag(w) V^T``; ``lambda``
is ``damping`` x the mean eigenvalue (0.1: kronfluence's heuristic). Memory: the matrix and its
eigenvectors, 2 P^2 float64; ``BUDGET_BYTES`` bounds the one, past it the CG path serves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..defaults import DAMPING
from ..errors import ConfigError
from .factors import damping
from .products import Flat, Products

BUDGET_BYTES = 2 << 30  # the P x P float64 matrix: P up to 16384
BLOCK_BYTES = 256 << 20  # identity columns per pass over the data: (P, k) float64


def check_dense(size: int) -> None:
    """Refuse a matrix over ``BUDGET_BYTES``."""
    need = size * size * 8
    if need > BUDGET_BYTES:
        raise ConfigError(
            f"the dense curvature of {size} parameters is a {size} x {size} float64 matrix "
            f"({need / 2**30:.1f} GiB, over the {BUDGET_BYTES / 2**30:.0f} GiB budget); use "
            "--solver cg (conjugate gradients) or select fewer parameters (params.include)",
            "--solver",
        )


def check_damping(factor: float) -> None:
    if not factor >= 0:  # NaN too
        raise ConfigError(f"--damping must be 0 or more, got {factor:g}", "--damping")


def dense_matrix(products: Products) -> Tensor:
    """(P, P) float64 on the CPU: C times the identity, in blocks of columns (a data pass each),
    symmetrised (the products' round-off)."""
    size = products.flat.size
    check_dense(size)
    step = max(1, BLOCK_BYTES // (8 * size))
    columns = [
        products(torch.eye(size, dtype=torch.float64)[:, lo : lo + step])
        for lo in range(0, size, step)
    ]
    matrix = torch.cat(columns, 1)
    return (matrix + matrix.T) / 2


def eigen_summary(values: Tensor) -> dict:
    """The eigenvalues' min, median, mean and max, and how many are 0 or below."""
    return {
        "min": values.min().item(),
        "median": values.median().item(),
        "mean": values.mean().item(),
        "max": values.max().item(),
        "nonpositive": int((values <= 0).sum()),
    }


class ExactInverse:
    """The preconditioner ``(C + lambda I)^-1`` from C's eigendecomposition: ``refs`` maps the
    reference directions, all parameters at once (C couples them), on the CPU in float64."""

    solver = "dense"

    def __init__(
        self, flat: Flat, values: Tensor, vectors: Tensor, factor: float = DAMPING, info=None
    ):
        check_damping(factor)
        self.flat, self.values, self.vectors = flat, values, vectors  # (P,), (P, P)
        self.factor, self.info = factor, dict(info or {})
        self.damping = damping(values, factor)
        smallest = values.min().item() + self.damping
        if smallest <= 0:
            raise ConfigError(
                f"the damped curvature is not positive definite (smallest eigenvalue "
                f"{values.min().item():.3g}, damping {self.damping:.3g}); raise --damping, or "
                "use --curvature gn (never negative)",
                "--damping",
            )

    @classmethod
    def fit(cls, products: Products, factor: float = DAMPING) -> ExactInverse:
        """C over the data, then its eigendecomposition."""
        check_damping(factor)
        values, vectors = torch.linalg.eigh(dense_matrix(products))  # (P,), (P, P)
        return cls(products.flat, values, vectors, factor, products.describe())

    def damped(self, factor: float) -> ExactInverse:
        """The same curvature under another damping: no pass over the data."""
        return ExactInverse(self.flat, self.values, self.vectors, factor, self.info)

    def solve(self, refs: Tensor) -> Tensor:
        """(K, P) -> (K, P) float64: ``(C + lambda I)^-1`` times each row."""
        rotated = refs.to(torch.float64) @ self.vectors  # (K, P) in the eigenbasis
        return (rotated / (self.values + self.damping)) @ self.vectors.T

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(C + lambda I)^-1 R`` per parameter, each in its reference's device and dtype."""
        solved = self.flat.unflatten(self.solve(self.flat.flatten(refs)))
        return {n: solved[n].to(r.device, r.dtype) for n, r in refs.items()}

    def describe(self) -> dict:
        return self.info | {
            "solver": self.solver,
            "damping": self.factor,
            "damping_absolute": self.damping,
            "eigenvalues": eigen_summary(self.values),
        }
