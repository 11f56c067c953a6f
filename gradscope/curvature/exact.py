"""The exact damped inverse of the Gauss-Newton matrix or the Hessian, dense: the P x P matrix
over the data (``products.py``), then ``(C + lambda I)^-1 R`` by its Cholesky factor.

``lambda`` is ``damping`` x the mean eigenvalue, trace(C) / P (``defaults.DAMPING``).
Another damping is another factor, no pass over the data: on the digits MLP (P = 8970) a
Cholesky takes ~7 s on one core, an eigendecomposition ~160 s, so up to some 20 dampings the
factor is cheaper. Memory: the matrix and its factor, 2 P^2 float64; ``BUDGET_BYTES`` bounds
the one, past it the CG path serves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .products import Flat, Products

BUDGET_BYTES = 2 << 30  # the P x P float64 matrix: P up to 16384
BLOCK_BYTES = 256 << 20  # identity columns per pass over the data: (P, k) float64
POWER_STEPS = 100


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
    if not 0 <= factor < float("inf"):  # NaN too; inf damps every score to 0
        raise ConfigError(f"--damping must be a finite 0 or more, got {factor:g}", "--damping")


def scaled_damping(mean: float, factor: float, estimated: bool = False) -> float:
    """lambda = ``factor`` x the curvature's ``mean`` eigenvalue (in float64). A mean of 0 (a
    loss linear in the model's outputs: its Gauss-Newton matrix is 0) or below (a Hessian whose
    negative curvature outweighs its positive) scales no damping: refused, not replaced by
    another lambda (which scored the plain inner product under the curvature's name)."""
    what = "estimated mean eigenvalue (--solver cg)" if estimated else "mean eigenvalue"
    if mean == 0:
        raise ConfigError(
            f"the curvature's {what} is 0: it is zero on these rows (a loss linear in the "
            "model's outputs, as nll and l1 are, has a Gauss-Newton matrix of 0), so --damping "
            "(a multiple of it) gives no damping; fit K-FAC or EK-FAC instead (their Fisher: "
            "curvature kfac or ekfac, or a factors file), or score with none",
            "--curvature",
        )
    if mean < 0:
        raise ConfigError(
            f"the curvature's {what} is {mean:.3g}: its negative curvature outweighs its "
            "positive, so --damping (a multiple of it) gives no damping; use --curvature gn "
            "(never negative for a convex loss)",
            "--damping",
        )
    return factor * mean


def dense_matrix(products: Products) -> Tensor:
    """(P, P) float64 on the CPU: C times the identity, in blocks of columns (a data pass each),
    symmetrised (the products' round-off)."""
    size = products.flat.size
    check_dense(size)
    step = max(1, BLOCK_BYTES // (8 * size))
    matrix = torch.empty(size, size, dtype=torch.float64)
    for lo in range(0, size, step):
        hi = min(size, lo + step)
        block = torch.zeros(size, hi - lo, dtype=torch.float64)  # identity columns lo..hi
        block[lo:hi] = torch.eye(hi - lo, dtype=torch.float64)
        matrix[:, lo:hi] = products(block)
    matrix += matrix.T.clone()
    return matrix.div_(2)


def largest_eigenvalue(matrix: Tensor, steps: int = POWER_STEPS, settled: float = 1e-12) -> float:
    """The largest eigenvalue of a PSD-ish symmetric matrix by power iteration (its Rayleigh
    quotient; P^2 a step), stopped once a step moves it by at most ``settled`` of itself (its
    error shrinks slower than its steps where the top eigenvalues are close): the
    metadata's summary, not the solve."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(matrix.shape[0], generator=g, dtype=matrix.dtype)
    v = v / v.norm()
    quotient = float("inf")
    for _ in range(steps):
        w = matrix @ v
        previous, quotient = quotient, (v @ w).item()
        if abs(quotient - previous) <= settled * abs(quotient):
            break
        v = w / w.norm().clamp_min(1e-300)
    return quotient


class ExactInverse:
    """The preconditioner ``(C + lambda I)^-1`` from C itself: one Cholesky factor per damping
    (P^3 / 3; an eigendecomposition costs some 20 of them), ``refs`` maps the reference
    directions, all parameters at once (C couples them), on the CPU in float64."""

    solver = "dense"

    def __init__(self, flat: Flat, matrix: Tensor, factor: float, info=None):
        check_damping(factor)
        self.flat, self.matrix = flat, matrix  # (P, P)
        self.factor, self.info = factor, dict(info or {})
        self.mean = (torch.trace(matrix) / matrix.shape[0]).item()  # the mean eigenvalue
        self.damping = scaled_damping(self.mean, factor)
        shifted = matrix + self.damping * torch.eye(matrix.shape[0], dtype=matrix.dtype)
        self.cholesky, failed = torch.linalg.cholesky_ex(shifted)  # (P, P) lower
        if failed:
            raise ConfigError(
                f"the damped curvature is not positive definite (damping {self.damping:.3g}, "
                f"{factor:g} x the mean eigenvalue {self.mean:.3g}); raise --damping"
                + ("" if self.info.get("kind") == "gn" else ", or use --curvature gn"),
                "--damping",
            )

    @classmethod
    def fit(cls, products: Products, factor: float) -> ExactInverse:
        """C over the data, then its factor under ``factor``."""
        check_damping(factor)
        return cls(products.flat, dense_matrix(products), factor, products.describe())

    def damped(self, factor: float) -> ExactInverse:
        """The same curvature under another damping: no pass over the data."""
        return ExactInverse(self.flat, self.matrix, factor, self.info)

    def solve(self, refs: Tensor) -> Tensor:
        """(K, P) -> (K, P) float64: ``(C + lambda I)^-1`` times each row."""
        return torch.cholesky_solve(refs.to(torch.float64).T, self.cholesky).T

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``(C + lambda I)^-1 R`` per parameter, each in its reference's device and dtype."""
        solved = self.flat.unflatten(self.solve(self.flat.flatten(refs)))
        return {n: solved[n].to(r.device, r.dtype) for n, r in refs.items()}

    def describe(self) -> dict:
        return self.info | {
            "solver": self.solver,
            "damping": self.factor,
            "damping_absolute": self.damping,
            "eigenvalues": {"mean": self.mean, "max": largest_eigenvalue(self.matrix)},
        }
