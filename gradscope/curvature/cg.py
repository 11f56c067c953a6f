"""The exact damped inverse of the Gauss-Newton matrix or the Hessian by conjugate gradients:
no P x P matrix, one pass over the data per iteration (``products.py``).

The K reference directions are solved together, each its own CG run sharing the passes (a
vmapped block of products); a direction stops once its relative residual
``||r_k|| / ||b_k||`` is at most ``tolerance`` (``--cg-tolerance``, in (0, 1)), the true
residual's, checked after. A run that does not get there in ``max_iterations``, or whose true
residual stays over it, is an error, never a silent approximation; so is a direction of zero or
negative curvature (a Hessian damped too little). The damping is ``damping`` x the mean
eigenvalue as on the dense path, the mean (trace / P) estimated with ``PROBES`` Rademacher
probes (Hutchinson; one more pass), which only sets the damping: the solve is exact for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..defaults import CG_TOLERANCE
from ..errors import ConfigError
from .exact import check_damping, scaled_damping
from .products import Products

TOLERANCE = CG_TOLERANCE  # relative residual per direction
MAX_ITERATIONS = 1000  # each one pass over the data
PROBES = 16  # Hutchinson probes for the mean eigenvalue
RESTARTS = 2  # solves again from the true residual, where the recurrence's drifted


def mean_eigenvalue(products: Products, probes: int = PROBES, seed: int = 0) -> float:
    """trace(C) / P, estimated as the mean of z^T C z / P over Rademacher vectors z."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 2, (products.flat.size, probes), generator=g).double() * 2 - 1  # (P, S)
    return ((z * products(z)).sum(0).mean() / products.flat.size).item()


def check_tolerance(tolerance: float) -> None:
    if not 0 < tolerance < 1:  # NaN too
        raise ConfigError(f"--cg-tolerance must be in (0, 1), got {tolerance:g}", "--cg-tolerance")


def conjugate_gradients(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    shift: float,
    target: Tensor,
    max_iterations: int = MAX_ITERATIONS,
    tolerance: float = TOLERANCE,
) -> tuple[Tensor, int]:
    """(P, K) solutions of ``(C + shift I) x_k = b_k`` to a residual norm of ``target`` (K,)
    and the iterations run (``tolerance`` the relative one it stands for, for the error);
    ``matvec`` maps (P, J) columns to C times them."""
    x, r = torch.zeros_like(b), b.clone()  # (P, K)
    p, rs = r.clone(), r.square().sum(0)  # (P, K), (K,)
    for iteration in range(max_iterations + 1):
        active = rs.sqrt() > target  # (K,)
        if not active.any():
            return x, iteration
        if iteration == max_iterations:
            break
        pa = p[:, active]  # (P, J)
        ap = matvec(pa) + shift * pa
        curvature = (pa * ap).sum(0)  # (J,)
        if (curvature <= 0).any():
            raise ConfigError(
                "conjugate gradients met a direction of zero or negative damped curvature; "
                "raise --damping, or use --curvature gn (never negative)",
                "--damping",
            )
        alpha = rs[active] / curvature
        x[:, active] += alpha * pa
        r[:, active] -= alpha * ap
        new = r[:, active].square().sum(0)
        p[:, active] = r[:, active] + (new / rs[active]) * pa
        rs[active] = new
    worst = (rs.sqrt() * tolerance / target.clamp_min(1e-300)).max().item()  # of the first b
    raise ConfigError(
        f"conjugate gradients did not converge in {max_iterations} iterations (relative "
        f"residual {worst:.2g}, tolerance {tolerance:g}); raise --damping or --cg-tolerance",
        "--damping",
    )


class CGInverse:
    """The preconditioner ``(C + lambda I)^-1`` applied by conjugate gradients on exact
    curvature-vector products; ``refs`` runs the solve and records what it took."""

    solver = "cg"

    def __init__(
        self,
        products: Products,
        factor: float,
        tolerance: float = TOLERANCE,
        max_iterations: int = MAX_ITERATIONS,
        mean: float | None = None,
    ):
        check_damping(factor)
        check_tolerance(tolerance)
        self.products, self.factor = products, factor
        self.tolerance, self.max_iterations = tolerance, max_iterations
        self.mean = mean_eigenvalue(products) if mean is None else mean
        self.damping = scaled_damping(self.mean, factor, estimated=True)
        self.iterations: int | None = None
        self.residual: float | None = None

    def solve(self, refs: Tensor) -> Tensor:
        """(K, P) -> (K, P) float64. The recurrence's residual drifts from the true one, so
        that is computed (one more pass) and, where over the tolerance, solved for again from
        there, ``RESTARTS`` times at most: then an error, the products' rounding in the
        model's dtype being the floor (a float32 model damped little)."""
        b = refs.to(torch.float64).T  # (P, K)
        target = self.tolerance * b.norm(dim=0)  # (K,)
        x, r, self.iterations = torch.zeros_like(b), b, 0
        for _ in range(RESTARTS + 1):
            dx, iterations = conjugate_gradients(
                self.products, r, self.damping, target, self.max_iterations, self.tolerance
            )
            x, self.iterations = x + dx, self.iterations + iterations
            r = b - self.products(x) - self.damping * x
            self.residual = (r.norm(dim=0) / b.norm(dim=0).clamp_min(1e-300)).max().item()
            if (r.norm(dim=0) <= target).all():
                return x.T
        raise ConfigError(
            f"conjugate gradients' true relative residual stays at {self.residual:.2g}, over "
            f"--cg-tolerance {self.tolerance:g}, after {RESTARTS} restarts: the curvature's "
            "products round at about that in the model's dtype at this damping; raise "
            "--cg-tolerance or --damping, or score in float64",
            "--cg-tolerance",
        )

    def refs(self, refs: dict[str, Tensor]) -> dict[str, Tensor]:
        flat = self.products.flat
        solved = flat.unflatten(self.solve(flat.flatten(refs)))
        return {n: solved[n].to(r.device, r.dtype) for n, r in refs.items()}

    def describe(self) -> dict:
        return self.products.describe() | {
            "solver": self.solver,
            "damping": self.factor,
            "damping_absolute": self.damping,
            "eigenvalues": {"mean": self.mean, "estimated_with_probes": PROBES},
            "iterations": self.iterations,
            "residual": self.residual,
            "tolerance": self.tolerance,
        }
