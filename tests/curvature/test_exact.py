"""The exact damped inverse of the GGN or Hessian (dense and conjugate gradients) through the
Python path, against the definition built whole with torch.func (``exact_oracle``), in float64."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from exact_oracle import assert_columns_close, exact_scores
from torch import Tensor, nn

import gradscope
from gradscope.curvature.cg import CGInverse
from gradscope.curvature.exact import ExactInverse
from gradscope.curvature.products import Products
from gradscope.engine import Engine
from gradscope.errors import ConfigError
from gradscope.losses import resolve_loss


class MLP(nn.Module):
    def __init__(self, out: int = 3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 4), nn.Linear(4, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Unused(MLP):
    """An MLP with a parameter its forward never reads: zero curvature there."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Parameter(torch.randn(2))


def pseudo_huber(outputs: Tensor, targets: Tensor) -> Tensor:
    """A user's loss: convex, not quadratic, one value per example."""
    return ((1 + (outputs - targets).square()).sqrt() - 1).sum(1)


@dataclass
class Case:
    model: type
    loss: object
    exclude: tuple = ()
    kind: str = "gn"

    def data(self, n: int, seed: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 5, generator=g, dtype=torch.float64)
        if self.loss == "cross_entropy":
            return x, torch.randint(0, 3, (n,), generator=g)
        return x, torch.randn(n, 3, generator=g, dtype=torch.float64)


CASES = {
    "mlp-ce-gn": Case(MLP, "cross_entropy"),
    "mlp-ce-hessian": Case(MLP, "cross_entropy", kind="hessian"),
    "mlp-mse-gn": Case(MLP, "mse"),
    "mlp-mse-hessian": Case(MLP, "mse", kind="hessian"),
    "unused-ce-gn": Case(Unused, "cross_entropy"),
    "exclude-fc1-ce-gn": Case(MLP, "cross_entropy", exclude=("fc1.*",)),
    "custom-gn": Case(MLP, pseudo_huber),
    "custom-hessian": Case(MLP, pseudo_huber, kind="hessian"),
}


def setup(case: Case):
    torch.manual_seed(0)
    model = case.model().double()
    x, y = case.data(12, 1)
    xr, yr = case.data(3, 2)
    excluded = ("fc1.weight", "fc1.bias") if case.exclude else ()
    names = [n for n, _ in model.named_parameters() if n not in excluded]
    return model, x, y, xr, yr, names


@pytest.mark.parametrize("per_ref", [False, True], ids=["mean", "per-ref"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_dense_scores_equal_the_definition(case: Case, per_ref: bool) -> None:
    model, x, y, xr, yr, names = setup(case)
    loss = resolve_loss(case.loss)
    # the hessian of a tanh MLP is indefinite: a damping it is positive definite under
    factor = 20.0 if case.kind == "hessian" else 0.1
    expected = exact_scores(model, loss, names, x, y, xr, yr, case.kind, factor, per_ref)
    if per_ref:  # each reference its own direction: one call per reference row
        got = torch.stack([
            gradscope.per_example_influence(
                model, x, y, xr[k : k + 1], yr[k : k + 1], case.loss, exclude=case.exclude,
                curvature=case.kind, damping=factor, solver="dense",
            )
            for k in range(len(yr))
        ], 1)  # fmt: skip
    else:
        got = gradscope.per_example_influence(
            model, x, y, xr, yr, case.loss, exclude=case.exclude, curvature=case.kind,
            damping=factor, solver="dense",
        )[:, None]  # fmt: skip
    assert_columns_close(got, expected)


def fitted(case: Case):
    model, x, y, xr, yr, names = setup(case)
    engine = Engine(model, resolve_loss(case.loss), exclude=case.exclude)
    batches = [(x[:5],), y[:5]], [(x[5:],), y[5:]]  # two batches: sums over both
    return engine, (lambda: [(tuple(i), t) for i, t in batches]), xr


@pytest.mark.parametrize("name", ["mlp-ce-gn", "unused-ce-gn", "mlp-mse-hessian"])
def test_cg_converges_to_the_dense_solution(name: str) -> None:
    case = CASES[name]
    engine, batches, _ = fitted(case)
    with engine:
        products = Products(engine, batches, case.kind)
        dense = ExactInverse.fit(products, 20.0)
        g = torch.Generator().manual_seed(3)
        refs = torch.randn(4, products.flat.size, generator=g, dtype=torch.float64)  # K = 4
        cg = CGInverse(products, 20.0, tolerance=1e-12, max_iterations=200, mean=dense.mean)
        solved = cg.solve(refs)
    torch.testing.assert_close(solved, dense.solve(refs), rtol=1e-6, atol=1e-10)
    described = cg.describe()
    assert 0 < described["iterations"] <= products.flat.size + 1
    assert described["residual"] < 1e-10
    assert dense.damping == pytest.approx(cg.damping)


def test_cg_refuses_to_stop_short() -> None:
    engine, batches, _ = fitted(CASES["mlp-ce-gn"])
    with engine:
        products = Products(engine, batches, "gn")
        cg = CGInverse(products, 1e-3, tolerance=1e-14, max_iterations=2)
        with pytest.raises(ConfigError, match="did not converge in 2 iterations"):
            cg.solve(torch.ones(1, products.flat.size, dtype=torch.float64))


def test_hutchinson_mean_eigenvalue_near_the_trace() -> None:
    engine, batches, _ = fitted(CASES["mlp-ce-gn"])
    with engine:
        products = Products(engine, batches, "gn")
        dense = ExactInverse.fit(products, 0.1)
        cg = CGInverse(products, 0.1)
    assert cg.mean == pytest.approx(dense.mean, rel=0.5)


def test_dampings_share_one_eigendecomposition() -> None:
    engine, batches, _ = fitted(CASES["mlp-ce-gn"])
    with engine:
        products = Products(engine, batches, "gn")
        dense = ExactInverse.fit(products, 0.1)
        passes = products.passes
        other = dense.damped(1.0)
    assert products.passes == passes and other.damping == pytest.approx(10 * dense.damping)
    with pytest.raises(ConfigError, match="--damping must be a finite 0 or more"):
        dense.damped(-1.0)


def test_indefinite_damped_hessian_is_refused() -> None:
    engine, batches, _ = fitted(CASES["mlp-ce-hessian"])
    with engine:
        dense = ExactInverse.fit(Products(engine, batches, "hessian"), 20.0)
    assert torch.linalg.eigvalsh(dense.matrix).min() < 0  # the tanh MLP's Hessian: indefinite
    with pytest.raises(ConfigError, match="not positive definite"):
        dense.damped(0.0)


def test_a_negative_mean_eigenvalue_is_refused_and_lambda_kept_in_float64() -> None:
    """A Hessian whose negative curvature outweighs its positive: --damping scaled a negative
    mean, and lambda became 1 whatever it asked (30, 1e6: the same scores). And lambda was the
    mean rounded to float32 times the factor."""
    engine, batches, _ = fitted(CASES["mlp-ce-gn"])
    with engine:
        dense = ExactInverse.fit(Products(engine, batches, "gn"), 0.1)
    flipped = ExactInverse(dense.flat, dense.matrix, 1.0)
    assert flipped.damping == dense.mean  # not float32's nearest
    negative = dense.matrix - 2 * dense.mean * torch.eye(dense.matrix.shape[0], dtype=torch.float64)
    for factor in (30.0, 1e6):
        with pytest.raises(ConfigError, match=r"mean eigenvalue is -.*outweighs its positive"):
            ExactInverse(dense.flat, negative, factor)


def refuse(*args, **kwargs):
    raise RuntimeError("vmap refuses")


@pytest.mark.parametrize("kind", ["gn", "hessian"])
def test_one_direction_at_a_time_where_vmap_cannot_run(monkeypatch, kind: str) -> None:
    """The loop over directions gives the vmapped products; the reason is recorded."""
    engine, batches, _ = fitted(CASES[f"mlp-ce-{kind}"])
    block = torch.randn(39, 3, dtype=torch.float64)  # (P, K): the MLP has 39 parameters
    with engine:
        vmapped = Products(engine, batches, kind)(block)
        monkeypatch.setattr("gradscope.curvature.products.vmap", refuse)
        products = Products(engine, batches, kind)
        looped = products(block)
    torch.testing.assert_close(looped, vmapped, rtol=1e-12, atol=1e-14)
    assert products.describe()["vmap"] == "RuntimeError: vmap refuses"


@pytest.mark.parametrize("kind", ["gn", "hessian"])
def test_an_example_of_no_finite_gradient_is_left_out_of_the_curvature(kind: str) -> None:
    """The default influence (the exact GGN) refused the whole run for one row with a NaN or
    inf input ("the curvature is not finite"), where the columns promise that row `finite`
    false and the others unaffected: it is left out of C, as the factors leave it out, and
    every other row scores as on the data without it. An inf input whose loss is finite
    (tanh saturates) and a NaN one."""
    model, x, y, xr, yr, _ = setup(CASES[f"mlp-ce-{kind}"])
    bad = x.clone()
    bad[3, 0], bad[7, 2] = float("inf"), float("nan")
    keep = [i for i in range(len(x)) if i not in (3, 7)]
    ref = {"x": xr, "y": yr}
    options = {"curvature": kind, "solver": "dense", "batch_size": 5}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = gradscope.influence(model, {"x": bad, "y": y}, ref=ref, **options)
    want = gradscope.influence(model, {"x": x[keep], "y": y[keep]}, ref=ref, **options)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert got["finite"].tolist() == [i in keep for i in range(len(x))]
    torch.testing.assert_close(
        torch.tensor(got["influence"].to_numpy()[keep]), torch.tensor(want["influence"].to_numpy()),
        rtol=1e-10, atol=0,
    )  # fmt: skip
