"""Curvature fitted in the same run as the scores (``influence --curvature``): the exact
Gauss-Newton matrix or Hessian (dense where it fits, else conjugate gradients), or K-FAC /
EK-FAC factors, over the config's data (the rows a run scores: the training set)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..defaults import CURVATURE, DAMPING
from ..errors import ConfigError
from .cg import TOLERANCE, CGInverse, check_tolerance
from .exact import BUDGET_BYTES, ExactInverse, check_damping
from .factors import EKFAC, KFAC, redamp
from .fisher import SAMPLED
from .precondition import Curvature
from .products import GN, HESSIAN, Batches, Products

NONE, AUTO = "none", "auto"
LINEAR_IN_OUTPUTS = ("nll", "l1")  # losses whose Hessian in the outputs is 0
CURVATURES = (AUTO, NONE, GN, HESSIAN, KFAC, EKFAC)
SOLVERS = ("auto", "dense", "cg")


def check_curvature(
    curvature: str,
    solver: str,
    damping: float | None,
    precondition: object,
    tolerance: float = TOLERANCE,
) -> None:
    """The options' values, before anything runs."""
    if curvature is None:  # the default, resolved with the precondition
        curvature = resolve_curvature(curvature, precondition)
    elif curvature not in CURVATURES:
        raise ConfigError(
            f"--curvature must be one of {', '.join(CURVATURES)}, got {curvature!r}",
            "--curvature",
        )
    if solver not in SOLVERS:
        raise ConfigError(
            f"--solver must be one of {', '.join(SOLVERS)}, got {solver!r}", "--solver"
        )
    if damping is not None:
        check_damping(damping)
    check_tolerance(tolerance)
    if curvature != NONE and precondition is not None:
        raise ConfigError(
            f"--curvature {curvature} fits a curvature in this run and --precondition reads "
            "one from a file: give one of them",
            "--precondition",
        )
    given = {"--damping": damping is not None, "--solver": solver != AUTO,
             "--cg-tolerance": tolerance != TOLERANCE}  # fmt: skip
    unread = [name for name, set_ in given.items() if set_]
    if curvature == NONE and unread:
        why = "--precondition reads a fitted one" if precondition else "--curvature none fits none"
        raise ConfigError(f"{unread[0]} sets the curvature fitted in this run; {why}", unread[0])
    solving = [name for name in ("--solver", "--cg-tolerance") if given[name]]
    if curvature in (KFAC, EKFAC) and solving:  # its metadata said solver cg, and none ran
        raise ConfigError(
            f"{solving[0]} sets how gn and hessian are solved; --curvature {curvature} inverts "
            "its factors as they are",
            solving[0],
        )
    if solver == "dense" and given["--cg-tolerance"]:
        raise ConfigError("--cg-tolerance stops --solver cg; --solver dense reads none", "--solver")


def resolve_curvature(curvature: str | None, precondition: object) -> str:
    """``curvature``, or the default: ``defaults.CURVATURE``, none where a ``--precondition``
    file gives the curvature."""
    if curvature is not None:
        return curvature
    return NONE if precondition is not None else CURVATURE


def resolve_damping(curvature: str, damping: float | None) -> float | None:
    """``damping``, or the curvature's default (none for ``none``)."""
    return DAMPING.get(curvature) if damping is None else damping


def pick_solver(solver: str, size: int) -> str:
    """``auto``: dense where the P x P matrix fits the budget, else conjugate gradients."""
    if solver != "auto":
        return solver
    return "dense" if size * size * 8 <= BUDGET_BYTES else "cg"


def fit_exact(
    engine,
    batches: Callable[[], Batches],
    kind: str = GN,
    solver: str = "auto",
    damping: float | None = None,
    tolerance: float = TOLERANCE,
) -> ExactInverse | CGInverse:
    """``(C + lambda I)^-1`` for C the GGN (``gn``) or the Hessian of the mean loss over
    ``batches()``, ``lambda`` = ``damping`` (None: ``defaults.DAMPING``'s) x C's mean
    eigenvalue, by conjugate gradients to ``tolerance`` where the dense matrix does not serve;
    the engine entered."""
    damping = resolve_damping(kind, damping)
    products = Products(engine, batches, kind)
    if pick_solver(solver, products.flat.size) == "dense":
        if tolerance != TOLERANCE:  # ran as without it, the metadata saying solver dense
            raise ConfigError(
                f"--cg-tolerance stops --solver cg; {products.flat.size} parameters are solved "
                "dense here: pass --solver cg",
                "--cg-tolerance",
            )
        return ExactInverse.fit(products, damping)
    return CGInverse(products, damping, tolerance)


class Timed:
    """A preconditioner with the seconds its fit took, and the curvature's name."""

    def __init__(self, inner, curvature: str, damping: float | None, seconds: float, why: str = ""):
        self.inner, self.curvature, self.seconds = inner, curvature, seconds
        self.damping, self.why = damping, why

    def refs(self, refs: dict) -> dict:
        start = time.perf_counter()
        out = self.inner.refs(refs)
        self.seconds += time.perf_counter() - start  # CG solves here
        return out

    def describe(self) -> dict:
        described = {"damping": self.damping} | self.inner.describe()
        return described | {"curvature": self.curvature, "why": self.why, "seconds": self.seconds}


def chosen(curvature: str, solver: str, parameters: int, loss: str = "") -> tuple[str, str]:
    """What ``auto`` fits for a selection of ``parameters`` numbers under ``loss``, and why:
    the exact Gauss-Newton inverse where its dense matrix fits the budget (or ``--solver``
    asks for it), else EK-FAC, the scalable curvature (its LDS on the benchmarks: the docs'
    curvature guide), which also serves a loss linear in the outputs (Gauss-Newton matrix 0);
    any other name as it is."""
    if curvature != AUTO:
        return curvature, "asked for"
    if solver != AUTO:  # the matrix dense or cg solves (a dense one past the budget: refused)
        return GN, f"auto: --solver {solver} solves the Gauss-Newton matrix"
    if loss in LINEAR_IN_OUTPUTS:
        return (
            EKFAC,
            f"auto: {loss} is linear in the model's outputs (its Gauss-Newton matrix is 0)",
        )
    if parameters * parameters * 8 <= BUDGET_BYTES:
        return GN, f"auto: {parameters} parameters, the dense Gauss-Newton matrix fits"
    return EKFAC, f"auto: {parameters} parameters, too many for the dense Gauss-Newton matrix"


def fit_curvature(
    job,
    curvature: str,
    solver: str = "auto",
    damping: float | None = None,
    tolerance: float = TOLERANCE,
) -> Timed:
    """The curvature named by ``--curvature`` (``auto``: ``chosen``'s) over the job's data,
    timed; ``tolerance`` the conjugate gradients'."""
    from ..io.data import open_dataset
    from . import compute_factors

    parameters = sum(p.param.numel() for p in job.engine.plan.included)
    curvature, why = chosen(curvature, solver, parameters, job.cfg.loss.name)
    damping = resolve_damping(curvature, damping)
    start = time.perf_counter()
    if curvature in (KFAC, EKFAC):
        if tolerance != TOLERANCE:  # auto chose it (a loss linear in the outputs, or too many)
            raise ConfigError(f"--cg-tolerance stops --solver cg; {why}: ekfac", "--cg-tolerance")
        if not damping > 0:  # an unused input's factor has zero eigenvalues: 1 / 0
            raise ConfigError(f"--curvature {curvature} needs a --damping above 0", "--damping")
        fisher = "true" if job.cfg.loss.name in SAMPLED else "empirical"
        factors = compute_factors(job, ekfac=curvature == EKFAC, fisher=fisher)
        redamp(factors.blocks, damping)
        inner = Curvature(factors)
    else:
        cfg = job.cfg
        dataset = open_dataset(cfg.data)

        def batches():
            for batch in dataset.batches(cfg.data.batch_size, cfg.data.limit):
                yield job.to_device(batch)

        inner = fit_exact(job.engine, batches, curvature, solver, damping, tolerance)
    return Timed(inner, curvature, damping, time.perf_counter() - start, why)
