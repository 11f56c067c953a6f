"""``influence --curvature``: the curvature fitted in the same run, through the CLI, against the
definition (``exact_oracle``) and against ``factors`` then ``--precondition``; its bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from exact_oracle import assert_columns_close, curvature_matrix, exact_scores
from project import edit_config, edit_data, fails, load_net, make_project
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.curvature import precondition
from gradscope.defaults import DAMPING
from gradscope.engine import influence
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss
from gradscope.rules import factored

N = 10
LOSS_PY = """
def pseudo_huber(outputs, targets):
    return ((1 + (outputs - targets) ** 2).sqrt() - 1).sum(1)
"""


def _invoke(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def project(root: Path, loss: str, **config) -> Path:
    """make_project in float64, with float targets for regression losses, and a REF."""
    (root / "loss.py").write_text(LOSS_PY)
    name = "loss.py:pseudo_huber" if loss == "custom" else loss
    cfg = make_project(root, n=N, dtype="float64", loss={"name": name}, **config)
    g = torch.Generator().manual_seed(5)
    if loss != "cross_entropy":
        edit_data(root, lambda d: d.update(y=torch.randn(N, 3, generator=g)))
        ref_y = torch.randn(3, 3, generator=g)
    else:
        ref_y = torch.randint(0, 3, (3,), generator=g)
    torch.save({"x": torch.randn(3, 5, generator=g), "y": ref_y}, root / "ref.pt")
    return cfg


def problem(root: Path, loss: str):
    """The project's model in float64, its loss, data and REF, for the oracle."""
    net, x, y = load_net(root)
    ref = torch.load(root / "ref.pt")
    fn = resolve_loss(
        (lambda o, t: ((1 + (o - t) ** 2).sqrt() - 1).sum(1)) if loss == "custom" else loss
    )
    x, xr = x.double(), ref["x"].double()
    y, yr = (y, ref["y"]) if loss == "cross_entropy" else (y.double(), ref["y"].double())
    return net.double(), fn, x, y, xr, yr


def oracle(root: Path, loss: str, names, kind="gn", factor=0.1, per_ref=False, lam=None):
    net, fn, x, y, xr, yr = problem(root, loss)
    return exact_scores(net, fn, names, x, y, xr, yr, kind, factor, per_ref, lam)


def oracle_matrix(root: Path, loss: str, names, kind: str):
    net, fn, x, y, _, _ = problem(root, loss)
    return curvature_matrix(net, fn, names, x, y, kind)


ALL = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.mark.parametrize(
    ("loss", "kind", "per_ref", "exclude"),
    [
        ("cross_entropy", "gn", False, []),
        ("cross_entropy", "gn", True, []),
        ("cross_entropy", "hessian", False, []),
        ("mse", "gn", True, []),
        ("custom", "gn", False, []),
        ("cross_entropy", "gn", False, ["fc1.*"]),
    ],
    ids=["ce-gn", "ce-gn-per-ref", "ce-hessian", "mse-gn-per-ref", "custom-gn", "exclude-fc1"],
)
def test_dense_scores_equal_the_definition(tmp_path, loss, kind, per_ref, exclude) -> None:
    cfg = project(tmp_path, loss, params={"exclude": exclude})
    out = tmp_path / "s.parquet"
    factor = "50" if kind == "hessian" else "0.1"
    flags = ["--per-ref"] if per_ref else []
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--out", out, "--curvature", kind,
            "--damping", factor, "--batch-size", "3", *flags)  # fmt: skip
    names = [n for n in ALL if not (exclude and n.startswith("fc1"))]
    expected = oracle(tmp_path, loss, names, kind, float(factor), per_ref)  # (N, K)
    frame = pd.read_parquet(out)
    got = frame["influence"].to_numpy().reshape(N, -1)
    assert_columns_close(got, expected)
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    assert fit["curvature"] == kind and fit["solver"] == "dense" and fit["damping"] == float(factor)
    net = load_net(tmp_path)[0]
    size = sum(p.numel() for n, p in net.named_parameters() if n in names)
    assert fit["examples"] == N and fit["seconds"] > 0 and fit["parameters"] == size
    c = oracle_matrix(tmp_path, loss, names, kind)
    values = torch.linalg.eigvalsh(c)
    assert fit["eigenvalues"]["mean"] == pytest.approx(values.mean().item(), rel=1e-9)
    assert fit["eigenvalues"]["max"] == pytest.approx(values.max().item(), rel=1e-6)


def test_cg_through_the_cli(tmp_path) -> None:
    cfg = project(tmp_path, "cross_entropy")
    out = tmp_path / "s.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--out", out, "--curvature", "gn",
            "--solver", "cg", "--per-ref")  # fmt: skip
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    assert fit["solver"] == "cg" and fit["iterations"] > 0 and fit["residual"] <= 1e-6
    assert fit["damping"] == DAMPING["gn"]  # no --damping: the exact curvatures' default
    # the damping from the estimated mean eigenvalue; the solve exact for it
    expected = oracle(tmp_path, "cross_entropy", ALL, per_ref=True, lam=fit["damping_absolute"])
    got = pd.read_parquet(out)["influence"].to_numpy().reshape(N, -1)
    assert_columns_close(got, expected, 1e-4)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_factors_in_the_run_equal_factors_then_precondition(tmp_path, kind) -> None:
    cfg = project(tmp_path, "cross_entropy")
    ref, factors = tmp_path / "ref.pt", tmp_path / "f.safetensors"
    _invoke("factors", cfg, "--out", factors, *(["--ekfac"] if kind == "ekfac" else []))
    _invoke(
        "influence", cfg, "--ref", ref, "--out", tmp_path / "a.parquet", "--precondition", factors
    )
    _invoke("influence", cfg, "--ref", ref, "--out", tmp_path / "b.parquet", "--curvature", kind)
    a, b = (pd.read_parquet(tmp_path / f"{k}.parquet")["influence"] for k in "ab")
    np.testing.assert_allclose(b.to_numpy(), a.to_numpy(), rtol=1e-9)
    (fit,) = read_metadata(tmp_path / "b.parquet")["influence"]["curvatures"]
    assert fit["kind"] == kind and fit["damping"] == 0.1 and fit["fisher"] == "true"


@pytest.mark.parametrize("per_ref", [False, True], ids=["mean", "per-ref"])
def test_kfac_in_the_run_keeps_factored_references_factored(tmp_path, monkeypatch, per_ref):
    """``--curvature kfac`` with every Outer's reference kept as its factors (whatever they
    cost) and every weight its K-FAC block: preconditioned as factors still, the scores of
    the factors file's, formed."""
    monkeypatch.setattr("gradscope.curvature.factors.FULL_ELEMENTS", 0)
    cfg = project(tmp_path, "cross_entropy")
    ref, factors = tmp_path / "ref.pt", tmp_path / "f.safetensors"
    _invoke("factors", cfg, "--out", factors)
    flags = ["--per-ref"] if per_ref else []
    _invoke("influence", cfg, "--ref", ref, "--out", tmp_path / "a.parquet", "--precondition",
            factors, *flags)  # fmt: skip
    kept = []
    real = precondition._factored
    monkeypatch.setattr(influence, "cheaper", lambda *args, **kwargs: True)
    monkeypatch.setattr(factored, "cheaper", lambda *args, **kwargs: True)
    monkeypatch.setattr(precondition, "_factored", lambda *a: kept.append(a) or real(*a))
    _invoke("influence", cfg, "--ref", ref, "--out", tmp_path / "b.parquet", "--curvature",
            "kfac", *flags)  # fmt: skip
    a, b = (pd.read_parquet(tmp_path / f"{k}.parquet")["influence"] for k in "ab")
    np.testing.assert_allclose(b.to_numpy(), a.to_numpy(), rtol=1e-9)
    assert kept


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--curvature", "newton"],
            "--curvature must be one of auto, none, gn, hessian, kfac, ekfac",
        ),
        (["--curvature", "gn", "--damping", "-1"], "--damping must be a finite 0 or more, got -1"),
        (["--curvature", "gn", "--solver", "lu"], "--solver must be one of auto, dense, cg"),
        (["--curvature", "gn", "--precondition", "PRE"], "give one of them (--precondition)"),
        (["--curvature", "gn", "--solver", "dense"], "over the 0 GiB budget); use --solver cg"),
        # read by no curvature: the run went on as without them (its metadata said damping 0.5)
        (["--precondition", "PRE", "--damping", "0.5"], "--precondition reads a fitted one"),
        (["--curvature", "none", "--solver", "cg"], "--curvature none fits none (--solver)"),
        (["--curvature", "ekfac", "--damping", "0"], "--curvature ekfac needs a --damping above 0"),
        # read by nothing: the metadata said solver cg, damping inf scored every row 0
        (["--curvature", "kfac", "--solver", "cg"], "--curvature kfac inverts its factors"),
        (["--curvature", "ekfac", "--cg-tolerance", "0.5"], "--cg-tolerance sets how gn"),
        (["--solver", "dense", "--cg-tolerance", "0.5"], "--solver dense reads none"),
        (["--curvature", "kfac", "--damping", "inf"], "--damping must be a finite 0 or more"),
    ],
    ids=[
        "unknown",
        "negative",
        "solver",
        "both",
        "too-large",
        "damping-unread",
        "solver-unread",
        "ekfac-undamped",
        "kfac-solver",
        "ekfac-tolerance",
        "dense-tolerance",
        "infinite-damping",
    ],  # fmt: skip
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, flags, message) -> None:
    cfg = project(tmp_path, "cross_entropy")
    (tmp_path / "pre.pt").write_bytes(b"")
    monkeypatch.setattr("gradscope.curvature.exact.BUDGET_BYTES", 1000)  # 11 parameters
    flags = [str(tmp_path / "pre.pt") if f == "PRE" else f for f in flags]
    err = fails(monkeypatch, capsys, "influence", cfg, "--ref", tmp_path / "ref.pt", *flags)
    assert message in err
    assert not (tmp_path / "scores.parquet").exists()


def test_each_checkpoint_its_own_curvature(tmp_path) -> None:
    """TracIn with --curvature: sum_k w_k g_i(k) . (C_k + lambda_k I)^-1 g_ref(k)."""
    cfg = project(tmp_path, "cross_entropy")
    first = {k: v * 0.5 for k, v in torch.load(tmp_path / "net.pt").items()}
    torch.save(first, tmp_path / "net0.pt")
    ckpts = [{"path": "net0.pt", "weight": 0.5}, {"path": "net.pt", "weight": 2.0}]
    edit_config(tmp_path, lambda raw: raw["model"].update(checkpoint=None, checkpoints=ckpts))
    out = tmp_path / "s.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--out", out, "--curvature", "gn")
    fits = read_metadata(out)["influence"]["curvatures"]
    assert len(fits) == 2 and fits[0]["eigenvalues"]["mean"] != fits[1]["eigenvalues"]["mean"]
    net, fn, x, y, xr, yr = problem(tmp_path, "cross_entropy")
    expected = 2.0 * exact_scores(net, fn, ALL, x, y, xr, yr, "gn", DAMPING["gn"])
    net.load_state_dict({k: v.double() for k, v in first.items()})
    expected += 0.5 * exact_scores(net, fn, ALL, x, y, xr, yr, "gn", DAMPING["gn"])
    got = pd.read_parquet(out)["influence"].to_numpy().reshape(N, -1)
    assert_columns_close(got, expected)


def test_the_default_curvature_is_one_constant(tmp_path, monkeypatch) -> None:
    """defaults.CURVATURE switched to gn: influence with no flags fits it; a --precondition
    file still gives the curvature alone."""
    cfg = project(tmp_path, "cross_entropy")
    monkeypatch.setattr("gradscope.curvature.fitted.CURVATURE", "gn")
    ref, out = tmp_path / "ref.pt", tmp_path / "s.parquet"
    _invoke("influence", cfg, "--ref", ref, "--out", out)
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    assert fit["curvature"] == "gn" and fit["damping"] == DAMPING["gn"]
    got = pd.read_parquet(out)["influence"].to_numpy().reshape(N, -1)
    assert_columns_close(got, oracle(tmp_path, "cross_entropy", ALL, factor=DAMPING["gn"]))
    factors = tmp_path / "f.safetensors"
    _invoke("factors", cfg, "--out", factors)
    _invoke(
        "influence", cfg, "--ref", ref, "--out", tmp_path / "p.parquet", "--precondition", factors
    )
    meta = read_metadata(tmp_path / "p.parquet")["influence"]
    assert meta["curvature"] == "none" and meta["curvatures"] == []
    assert meta["precondition"]["kind"] == "kfac"


def test_auto_fits_the_exact_gauss_newton_where_it_fits(tmp_path) -> None:
    """--curvature auto on a small model: the dense Gauss-Newton inverse at its damping, said
    so in the metadata; in Python too."""
    import gradscope

    cfg = project(tmp_path, "cross_entropy")
    out = tmp_path / "s.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--out", out, "--curvature", "auto")
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    assert fit["curvature"] == "gn" and fit["solver"] == "dense"
    assert fit["why"] == "auto: 75 parameters, the dense Gauss-Newton matrix fits"
    expected = oracle(tmp_path, "cross_entropy", ALL, factor=DAMPING["gn"])
    assert_columns_close(pd.read_parquet(out)["influence"].to_numpy().reshape(N, -1), expected)
    net, fn, x, y, xr, yr = problem(tmp_path, "cross_entropy")
    api = gradscope.per_example_influence(net, x, y, xr, yr, loss="cross_entropy",
                                          curvature="auto")  # fmt: skip
    assert_columns_close(api.numpy()[:, None], expected)


def test_a_loss_linear_in_the_outputs_has_no_gauss_newton_matrix(tmp_path, monkeypatch, capsys):
    """l1 (as nll) has a Gauss-Newton matrix of 0: lambda was then 1, and the "exact" scores
    the plain inner product under gn's name. Refused now; auto fits EK-FAC's Fisher."""
    cfg = project(tmp_path, "l1")
    out = tmp_path / "s.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--out", out)
    (fit,) = read_metadata(out)["influence"]["curvatures"]
    assert fit["curvature"] == "ekfac" and "l1 is linear in the model's outputs" in fit["why"]
    for flags in (["--curvature", "gn"], ["--curvature", "gn", "--solver", "cg"]):
        err = fails(monkeypatch, capsys, "influence", cfg, "--ref", tmp_path / "ref.pt", *flags)
        assert "mean eigenvalue" in err and "is 0: it is zero on these rows" in err, err


def test_a_tolerance_beside_a_dense_solve_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """--cg-tolerance where auto solves dense ran as without it, the metadata saying dense."""
    cfg = project(tmp_path, "cross_entropy")
    err = fails(monkeypatch, capsys, "influence", cfg, "--ref", tmp_path / "ref.pt",
                "--cg-tolerance", "0.5")  # fmt: skip
    assert "75 parameters are solved dense here: pass --solver cg" in err


def test_auto_takes_ekfac_where_the_dense_matrix_does_not_fit() -> None:
    from gradscope.curvature.fitted import chosen

    assert chosen("auto", "auto", 16384) == ("gn", "auto: 16384 parameters, the dense "
                                            "Gauss-Newton matrix fits")  # fmt: skip
    assert chosen("auto", "auto", 16385)[0] == "ekfac"
    assert chosen("auto", "cg", 10**6)[0] == "gn"  # CG asked for: the exact inverse, solved
    assert chosen("auto", "dense", 16385)[0] == "gn"  # refused as past the budget, not ekfac
    assert chosen("hessian", "auto", 10**6) == ("hessian", "asked for")


def test_a_row_of_no_finite_gradient_through_the_command(tmp_path: Path) -> None:
    """The command as the API (tests/curvature/test_exact.py): a NaN row's `finite` false, the
    curvature fitted without it (`left_out` 1), every other row's influence that of the data
    without it. Two runs of batches of 4: the NaN in the second batch, then in the first."""
    cfg = project(tmp_path, "cross_entropy")
    data = torch.load(tmp_path / "data.pt")
    args = ["--ref", tmp_path / "ref.pt", "--curvature", "gn", "--solver", "dense"]
    for row in (5, 1):
        keep = [i for i in range(N) if i != row]
        torch.save({k: v[keep] for k, v in data.items()}, tmp_path / "data.pt")
        _invoke("influence", cfg, *args, "--out", tmp_path / "clean.parquet")
        bad = {k: v.clone() for k, v in data.items()}
        bad["x"][row, 0] = float("nan")
        torch.save(bad, tmp_path / "data.pt")
        _invoke("influence", cfg, *args, "--out", tmp_path / "nan.parquet")
        got, want = (pd.read_parquet(tmp_path / f) for f in ("nan.parquet", "clean.parquet"))
        assert got["finite"].tolist() == [i != row for i in range(N)]
        np.testing.assert_allclose(got["influence"][keep], want["influence"], rtol=1e-10)
        (fit,) = read_metadata(tmp_path / "nan.parquet")["influence"]["curvatures"]
        assert fit["left_out"] == 1 and fit["examples"] == N - 1
