"""`gradscope factors`, and `--precondition` with its file on norms and influence, end to end."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from project import load_net, make_project
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app, main
from gradscope.curvature import Factors, load_preconditioner
from gradscope.engine import Engine, naive_grads
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss

N = 10


def _invoke(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def _fails(monkeypatch, capsys, *args) -> str:
    monkeypatch.setattr(sys, "argv", ["gradscope", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
def test_factors_then_precondition(tmp_path: Path, ekfac: bool) -> None:
    cfg = make_project(tmp_path, n=N)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, tmp_path / "ref.pt")
    factors = tmp_path / "f.safetensors"
    flags = ["--ekfac"] if ekfac else []
    output = _invoke("factors", cfg, "--out", factors, "--fisher", "empirical", *flags)
    kind = "ekfac" if ekfac else "kfac"
    assert f"{N} examples, empirical Fisher; 2 {kind}, 2 diagonal" in output
    made = Factors.load(factors)
    assert made.meta["model"]["checkpoint_sha256"] and made.meta["examples"] == N

    out = tmp_path / "norms.parquet"
    _invoke("norms", cfg, "--precondition", factors, "--out", out)
    frame = pd.read_parquet(out)
    # the definition, with the preconditioner read back from the file
    net, x, y = load_net(tmp_path)
    net = net.double()
    loss = resolve_loss("cross_entropy")
    engine = Engine(net, loss)
    pre = load_preconditioner(factors, engine)
    names = [n for n, _ in net.named_parameters()]
    with engine:
        _, grads = naive_grads(net, (x.double(),), y, loss, names)
    expected = 0
    for n in names:
        g = grads[n].flatten(1)  # (B, P)
        pg = torch.stack([pre.refs({n: grads[n][i : i + 1]})[n].flatten() for i in range(N)])
        expected = expected + (g * pg).sum(1)
    torch.testing.assert_close(
        torch.tensor(frame["self_influence"].to_numpy()), expected, rtol=1e-4, atol=1e-6
    )
    meta = read_metadata(out)["precondition"]
    assert meta["kind"] == kind and meta["fisher"] == "empirical" and meta["sha256"]
    assert meta["parameters"] == {
        "fc1.weight": kind, "fc1.bias": "diagonal", "fc2.weight": kind, "fc2.bias": "diagonal"
    }  # fmt: skip

    out = tmp_path / "influence.parquet"
    _invoke("influence", cfg, "--ref", tmp_path / "ref.pt", "--precondition", factors, "--out", out)
    assert read_metadata(out)["influence"]["precondition"]["kind"] == kind
    net, x, y = load_net(tmp_path)  # the Python API takes the file too, on either engine
    ref = torch.load(tmp_path / "ref.pt")
    for engine in ("hooks", "jvp"):
        api = gradscope.per_example_influence(
            net, x, y, ref["x"], ref["y"], precondition=str(factors), engine=engine
        )
        torch.testing.assert_close(
            api.double(),
            torch.tensor(pd.read_parquet(out)["influence"].to_numpy()),
            rtol=1e-4,  # float32, by two routes (the CLI's pass forms norms beside)
            atol=1e-6,
        )


def test_adam_norms(tmp_path: Path) -> None:
    cfg = make_project(tmp_path, n=N)
    model, _, _ = load_net(tmp_path)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 5)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "adam.pt")
    out = tmp_path / "norms.parquet"
    _invoke("norms", cfg, "--precondition", tmp_path / "adam.pt", "--out", out)
    assert read_metadata(out)["precondition"]["kind"] == "adam"
    assert (pd.read_parquet(out)["self_influence"] > 0).all()  # values: test_curvature.py


def test_user_errors_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    cfg = make_project(tmp_path, n=N)
    factors = tmp_path / "f.safetensors"
    assert "--fisher must be true or empirical" in _fails(
        monkeypatch, capsys, "factors", cfg, "--out", factors, "--fisher", "fake"
    )
    assert "output path is the run's" in _fails(
        monkeypatch, capsys, "factors", cfg, "--out", tmp_path / "net.pt"
    )
    _invoke("factors", cfg, "--out", factors)
    other = make_project(tmp_path, n=N, params__exclude=["fc2.*"])
    err = _fails(monkeypatch, capsys, "norms", other, "--precondition", factors)
    assert "the factors do not fit the selected parameters (only in the factors: fc2" in err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "weights.safetensors")  # neither kind
    err = _fails(
        monkeypatch, capsys, "norms", cfg, "--precondition", tmp_path / "weights.safetensors"
    )
    assert "not an optimizer state_dict" in err
    net, _, _ = load_net(tmp_path)
    torch.save({k: v + 1 for k, v in net.state_dict().items()}, tmp_path / "net2.pt")
    cfg = make_project(tmp_path, n=N, model__checkpoint="net2.pt")
    err = _fails(monkeypatch, capsys, "norms", cfg, "--precondition", factors)
    assert "computed at another checkpoint" in err
