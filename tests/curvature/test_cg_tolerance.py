"""``--cg-tolerance`` / ``cg_tolerance=``: conjugate gradients stopped at a looser relative
residual score within what that residual allows of the exact solve (the definition,
``exact_oracle``), record the residual reached, and refuse a tolerance outside (0, 1).

What a residual allows: with r = b - (C + lambda I) x and C positive semi-definite (the
Gauss-Newton matrix), ``||x - x*|| <= ||r|| / lambda``, so example i's score against reference k
is off by at most ``||g_i|| ||b_k|| residual_k / lambda``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from exact_oracle import exact_scores, per_example_grads
from project import fails, load_net, make_project
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.errors import ConfigError
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss

N, FACTOR, LOOSE = 10, 0.1, 0.1
NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def project(root: Path) -> Path:
    """make_project in float64, and a REF of 3 rows."""
    cfg = make_project(root, n=N, dtype="float64")
    g = torch.Generator().manual_seed(5)
    ref = {"x": torch.randn(3, 5, generator=g), "y": torch.randint(0, 3, (3,), generator=g)}
    torch.save(ref, root / "ref.pt")
    return cfg


def scored(via: str, cfg: Path, out: Path, tolerance: float | None) -> tuple[np.ndarray, dict]:
    """(N, K) per-ref scores of ``--curvature gn --solver cg`` at ``tolerance`` (None: the
    default) through the CLI or the API, and what the fit recorded."""
    given = {} if tolerance is None else {"cg_tolerance": tolerance}
    ref = cfg.parent / "ref.pt"
    if via == "cli":
        flags = [x for k, v in given.items() for x in ("--cg-tolerance", str(v))]
        result = CliRunner().invoke(app, [
            "influence", str(cfg), "--ref", str(ref), "--out", str(out), "--per-ref",
            "--curvature", "gn", "--solver", "cg", "--damping", str(FACTOR), *flags])  # fmt: skip
        assert result.exit_code == 0, result.output
    else:
        gradscope.influence(cfg, ref=ref, out=out, per_ref=True, curvature="gn", solver="cg",
                            damping=FACTOR, **given)  # fmt: skip
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    return pd.read_parquet(out)["influence"].to_numpy().reshape(N, -1), fit


def allowed(root: Path, lam: float, residual: float, per_ref: bool = True):
    """The exact scores at ``lam`` (N, K) and how far a solve at ``residual`` may be from them."""
    net, x, y = load_net(root)
    ref = torch.load(root / "ref.pt")
    net, loss, x, xr = net.double(), resolve_loss("cross_entropy"), x.double(), ref["x"].double()
    exact = exact_scores(net, loss, NAMES, x, y, xr, ref["y"], "gn", FACTOR, per_ref, lam)
    g = per_example_grads(net, loss, NAMES, x, y).norm(dim=1)  # (N,)
    refs = per_example_grads(net, loss, NAMES, xr, ref["y"])  # (K, P)
    b = (refs if per_ref else refs.mean(0, keepdim=True)).norm(dim=1)  # (K,)
    return exact.numpy(), (g[:, None] * b[None, :] * residual / lam).numpy()


@pytest.mark.parametrize("via", ["cli", "api"])
def test_a_looser_tolerance_scores_within_its_residual(tmp_path, via) -> None:
    cfg = project(tmp_path)
    _, tight = scored(via, cfg, tmp_path / "tight.parquet", None)
    got, loose = scored(via, cfg, tmp_path / "loose.parquet", LOOSE)
    assert tight["tolerance"] == 1e-6 and tight["residual"] <= 1e-6
    assert loose["tolerance"] == LOOSE and 1e-6 < loose["residual"] <= LOOSE
    assert 0 < loose["iterations"] < tight["iterations"]  # it stopped sooner
    assert loose["damping_absolute"] == tight["damping_absolute"]
    exact, bound = allowed(tmp_path, loose["damping_absolute"], loose["residual"])
    error = np.abs(got - exact)
    assert (error <= bound * (1 + 1e-9)).all()
    assert (error > bound * 1e-6 / loose["residual"]).any()  # more than a 1e-6 solve's


def test_one_batch_takes_the_tolerance(tmp_path) -> None:
    """``per_example_influence(cg_tolerance=)``: the mean reference, within its residual's
    distance of the definition (the damping's estimate as the file's, same data)."""
    cfg = project(tmp_path)
    _, fit = scored("api", cfg, tmp_path / "s.parquet", LOOSE)
    net, x, y = load_net(tmp_path)
    ref = torch.load(tmp_path / "ref.pt")
    got = gradscope.per_example_influence(
        net.double(), x.double(), y, ref["x"].double(), ref["y"], curvature="gn", solver="cg",
        damping=FACTOR, cg_tolerance=LOOSE,
    )  # fmt: skip
    exact, bound = allowed(tmp_path, fit["damping_absolute"], LOOSE, per_ref=False)
    error = np.abs(got.numpy() - exact[:, 0])
    assert (error <= bound[:, 0] * (1 + 1e-9)).all()
    assert (error > bound[:, 0] * 1e-6 / LOOSE).any()  # more than a 1e-6 solve's


@pytest.mark.parametrize("tolerance", ["0", "1", "-0.5", "nan"])
def test_a_tolerance_outside_zero_one_is_one_line(tmp_path, monkeypatch, capsys, tolerance):
    cfg = project(tmp_path)
    err = fails(monkeypatch, capsys, "influence", cfg, "--ref", tmp_path / "ref.pt",
                "--curvature", "gn", "--solver", "cg", "--cg-tolerance", tolerance)  # fmt: skip
    assert f"--cg-tolerance must be in (0, 1), got {float(tolerance):g} (--cg-tolerance)" in err
    assert not (tmp_path / "scores.parquet").exists()
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\)"):
        gradscope.influence(cfg, ref=tmp_path / "ref.pt", curvature="gn", cg_tolerance=float(tolerance))  # fmt: skip


class _Rounding:
    """Products of a fixed positive definite C that round to ``noise`` of their size, as a
    float32 model's do: a floor under the true residual that no restart goes below."""

    def __init__(self, noise: float):
        g = torch.Generator().manual_seed(0)
        a = torch.randn(6, 6, generator=g, dtype=torch.float64)
        self.c, self.noise, self.g = a @ a.T, noise, g

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        exact = self.c @ block
        return exact * (1 + self.noise * torch.randn(exact.shape, generator=self.g))


def test_a_true_residual_over_the_tolerance_is_refused_not_recorded():
    """CG stopped on its recurrence's residual and recorded the true one, 7e-6 against a
    tolerance of 1e-6 on a probe's float32 CNN at damping 0.01, without a word. The true
    residual is solved for again from where it is, and where it stays over: an error."""
    from gradscope.curvature.cg import CGInverse

    b = torch.randn(2, 6, dtype=torch.float64)
    exact = CGInverse(_Rounding(0.0), 0.1, tolerance=1e-8, mean=1.0)
    x = exact.solve(b)
    assert exact.residual <= 1e-8
    torch.testing.assert_close(x.T, torch.linalg.solve(_Rounding(0.0).c + 0.1 * torch.eye(6), b.T))
    with pytest.raises(ConfigError, match=r"true relative residual stays at .* over --cg-tol"):
        CGInverse(_Rounding(1e-4), 0.1, tolerance=1e-8, mean=1.0).solve(b)
