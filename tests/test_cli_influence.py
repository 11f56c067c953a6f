"""`gradscope influence` end to end: columns, values against the loop, metadata, exit codes."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from oracle import reference_influence
from typer.testing import CliRunner

import gradscope.api
from gradscope.cli import app, main
from gradscope.io.parquet import read_metadata

MODEL = """
from torch import nn


def make():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
"""
N, K = 10, 3  # examples (three batches of 4) and reference examples


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "model.py").write_text(MODEL)
    for seed in (0, 1):
        torch.save(_model(seed).state_dict(), tmp_path / f"ckpt{seed}.pt")
    torch.manual_seed(2)
    for name, n in (("data.pt", N), ("ref.pt", K)):
        torch.save({"x": torch.randn(n, 4), "y": torch.randint(0, 3, (n,))}, tmp_path / name)
    return tmp_path


def _config(project: Path, **model) -> Path:
    cfg = {
        "model": {"factory": "model.py:make", **model},
        "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": 4},
        "device": "cpu",
        "output": {"path": "scores.parquet"},
    }
    path = project / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _oracle(project: Path, seed: int, per_ref: bool = False):
    data = torch.load(project / "data.pt")
    ref = torch.load(project / "ref.pt")
    return reference_influence(
        _model(seed), (data["x"],), data["y"], ((ref["x"],), ref["y"]), "cross_entropy", per_ref
    )


def _run(*args: str) -> pd.DataFrame:
    result = CliRunner().invoke(app, ["influence", *map(str, args)])
    assert result.exit_code == 0, result.output
    assert "top" in result.output and "wrote" in result.output
    return pd.read_parquet(args[-1])


def _fails(monkeypatch, capsys, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["gradscope", "influence", *map(str, args)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def _close(actual, expected, scale) -> None:
    err = (torch.as_tensor(actual).double() - expected).abs() / scale
    assert err.max().item() < 1e-5  # float32 model against the float64 loop, in cosine units


@pytest.mark.parametrize("engine", ["auto", "hooks", "jvp"])
def test_one_checkpoint(project: Path, engine: str) -> None:
    cfg = _config(project, checkpoint="ckpt0.pt")
    out = project / "out.parquet"
    frame = _run(cfg, "--ref", project / "ref.pt", "--engine", engine, "--out", out)
    assert list(frame.columns) == [
        "example_id", "loss", "grad_norm", "influence", "cosine", "target", "finite",
    ]  # fmt: skip
    assert frame["example_id"].tolist() == list(range(N)) and frame["finite"].all()
    expected, g_norm, r_norm = _oracle(project, 0)
    _close(frame["influence"], expected[:, 0], g_norm * r_norm)
    _close(frame["grad_norm"], g_norm, g_norm)
    _close(frame["cosine"], expected[:, 0] / (g_norm * r_norm), 1.0)
    meta = read_metadata(out)
    assert meta["command"] == "influence"
    info = meta["influence"]
    assert info["ref_examples"] == K and info["per_ref"] is False and info["precondition"] is None
    assert info["engines_used"] == ["jvp" if engine == "jvp" else "hooks"]
    assert info["checkpoints"][0]["ref_grad_norm"] == pytest.approx(r_norm.item(), rel=1e-5)


def test_checkpoints_are_weighted_and_summed(project: Path) -> None:
    ckpts = [{"path": "ckpt0.pt", "weight": 0.5}, {"path": "ckpt1.pt", "weight": 2.0}]
    frame = _run(
        _config(project, checkpoints=ckpts),
        "--ref",
        project / "ref.pt",
        "--out",
        project / "o.parquet",
    )
    assert [c for c in frame.columns if "@" in c] == [
        "loss@0",
        "grad_norm@0",
        "loss@1",
        "grad_norm@1",
    ]
    (i0, g0, r0), (i1, g1, r1) = _oracle(project, 0), _oracle(project, 1)
    influence = 0.5 * i0[:, 0] + 2.0 * i1[:, 0]
    scale = (0.5 * g0**2 + 2.0 * g1**2).sqrt() * (0.5 * r0**2 + 2.0 * r1**2).sqrt()
    _close(frame["influence"], influence, scale)
    _close(frame["cosine"], influence / scale, 1.0)
    _close(frame["grad_norm@0"], g0, g0)
    _close(frame["grad_norm@1"], g1, g1)
    assert (frame["grad_norm"] == frame["grad_norm@1"]).all()  # the last checkpoint's
    assert (frame["loss"] == frame["loss@1"]).all()
    meta = read_metadata(project / "o.parquet")
    assert [c["weight"] for c in meta["influence"]["checkpoints"]] == [0.5, 2.0]
    assert meta["checkpoint_sha256"]  # of the last checkpoint, the one the job's model holds


def test_per_ref_rows(project: Path) -> None:
    out = project / "pairs.parquet"
    frame = _run(
        _config(project, checkpoint="ckpt0.pt"),
        "--ref",
        project / "ref.pt",
        "--per-ref",
        "--out",
        out,
    )
    assert len(frame) == N * K
    assert frame["example_id"].tolist() == [i for i in range(N) for _ in range(K)]
    assert frame["ref_id"].tolist() == list(range(K)) * N
    expected, g_norm, r_norm = _oracle(project, 0, per_ref=True)
    scale = (g_norm[:, None] * r_norm[None]).flatten()
    _close(frame["influence"], expected.flatten(), scale)
    _close(frame["cosine"], expected.flatten() / scale, 1.0)
    assert read_metadata(out)["influence"]["per_ref"] is True


def test_precondition_file(project: Path) -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), project / "adam.pt")
    cfg = _config(project, checkpoint="ckpt0.pt")
    out = project / "pre.parquet"
    frame = _run(
        cfg, "--ref", project / "ref.pt", "--precondition", project / "adam.pt", "--out", out
    )
    plain = _run(cfg, "--ref", project / "ref.pt", "--out", project / "plain.parquet")
    assert not frame["influence"].equals(plain["influence"])  # values: tests/test_influence.py
    assert read_metadata(out)["influence"]["precondition"]["sha256"]


def test_user_errors_exit_2(project: Path, monkeypatch, capsys) -> None:
    cfg = _config(project, checkpoint="ckpt0.pt")
    ref = project / "ref.pt"
    monkeypatch.setattr(gradscope.api, "MAX_PER_REF", 2)
    assert "at most 2 reference examples; REF has 3" in _fails(
        monkeypatch, capsys, cfg, "--ref", ref, "--per-ref"
    )
    assert "engine must be one of" in _fails(
        monkeypatch, capsys, cfg, "--ref", ref, "--engine", "fast"
    )
    assert "data file not found" in _fails(monkeypatch, capsys, cfg, "--ref", project / "nope.pt")
    other = torch.nn.Linear(4, 3)
    torch.save(torch.optim.Adam(other.parameters()).state_dict(), project / "other.pt")
    err = _fails(monkeypatch, capsys, cfg, "--ref", ref, "--precondition", project / "other.pt")
    assert "optimizer state has 2 parameters, the model has 4" in err
    both = _config(project, checkpoint="ckpt0.pt", checkpoints=[{"path": "ckpt1.pt"}])
    assert "not both" in _fails(monkeypatch, capsys, both, "--ref", ref)
    negative = _config(project, checkpoints=[{"path": "ckpt1.pt", "weight": -1}])
    assert "weights must be finite, >= 0" in _fails(monkeypatch, capsys, negative, "--ref", ref)
    missing = _config(project, checkpoints=[{"weight": 1}])
    assert "model.checkpoints[0].path" in _fails(monkeypatch, capsys, missing, "--ref", ref)
