"""`gradscope influence` end to end: columns, values against the loop, metadata, exit codes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from oracle import reference_influence
from project import fails, load_net, make_project
from typer.testing import CliRunner

import gradscope.scorers.influence
from gradscope.cli import app
from gradscope.io.parquet import read_metadata

N, K = 10, 3  # examples (three batches of 4) and reference examples


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """make_project's model, net.pt and data, plus a second checkpoint net1.pt and ref.pt."""
    make_project(tmp_path, n=N)
    net, _, _ = load_net(tmp_path)
    torch.manual_seed(1)
    torch.save({k: v + 0.3 * torch.randn_like(v) for k, v in net.state_dict().items()},
               tmp_path / "net1.pt")  # fmt: skip
    torch.save({"x": torch.randn(K, 5), "y": torch.randint(0, 3, (K,))}, tmp_path / "ref.pt")
    return tmp_path


def _config(project: Path, **model) -> Path:
    return make_project(project, n=N, **{f"model__{k}": v for k, v in model.items()})


def _oracle(project: Path, checkpoint: str = "net.pt", per_ref: bool = False):
    net, x, y = load_net(project)
    net.load_state_dict(torch.load(project / checkpoint))
    ref = torch.load(project / "ref.pt")
    return reference_influence(net, (x,), y, ((ref["x"],), ref["y"]), "cross_entropy", per_ref)


def _run(*args: str, summary: str = f"{N} examples; influence") -> pd.DataFrame:
    """``influence CONFIG ARGS`` as the plain inner product (``--curvature none``), which these
    tests compare with the loop; the curvatures have theirs in tests/curvature."""
    config, *rest = map(str, args)
    result = CliRunner().invoke(app, ["influence", config, "--curvature", "none", *rest])
    assert result.exit_code == 0, result.output
    assert "top" in result.output and summary in result.output and "wrote" in result.output
    return pd.read_parquet(args[-1])


def _close(actual, expected, scale) -> None:
    err = (torch.as_tensor(actual).double() - expected).abs() / scale
    assert err.max().item() < 1e-5  # float32 model against the float64 loop, in cosine units


@pytest.mark.parametrize("engine", ["auto", "hooks", "jvp"])
def test_one_checkpoint(project: Path, engine: str) -> None:
    cfg = _config(project, checkpoint="net.pt")
    out = project / "out.parquet"
    frame = _run(cfg, "--ref", project / "ref.pt", "--engine", engine, "--out", out)
    assert list(frame.columns) == [
        "example_id", "loss", "grad_norm", "influence", "cosine", "target", "pred", "prob",
        "margin", "robust_z", "class_z", "finite",
    ]  # fmt: skip
    assert frame["example_id"].tolist() == list(range(N)) and frame["finite"].all()
    expected, g_norm, r_norm = _oracle(project)
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
    ckpts = [{"path": "net.pt", "weight": 0.5}, {"path": "net1.pt", "weight": 2.0}]
    frame = _run(
        _config(project, checkpoint=None, checkpoints=ckpts),
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
    (i0, g0, r0), (i1, g1, r1) = _oracle(project), _oracle(project, "net1.pt")
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


def test_report_beside_the_scores(project: Path) -> None:
    out = project / "infl.parquet"
    _run(
        _config(project, checkpoint="net.pt"), "--ref", project / "ref.pt", "--report", "--out", out
    )
    page = (project / "infl.html").read_text()
    assert "influence: histogram" in page and "influence and cosine" in page
    # top-k 20 > N: every example, each shown, in the helpful and the harmful table
    assert page.count('<tr class="row">') == 2 * N
    assert page.count('<td class="example"') == 2 * N


def test_per_ref_rows(project: Path) -> None:
    out = project / "pairs.parquet"
    frame = _run(
        _config(project, checkpoint="net.pt"),
        "--ref",
        project / "ref.pt",
        "--per-ref",
        "--out",
        out,
        summary=f"{N * K} (example, reference) pairs; influence",
    )
    assert len(frame) == N * K
    assert frame["example_id"].tolist() == [i for i in range(N) for _ in range(K)]
    assert frame["ref_id"].tolist() == list(range(K)) * N
    expected, g_norm, r_norm = _oracle(project, per_ref=True)
    scale = (g_norm[:, None] * r_norm[None]).flatten()
    _close(frame["influence"], expected.flatten(), scale)
    _close(frame["cosine"], expected.flatten() / scale, 1.0)
    assert read_metadata(out)["influence"]["per_ref"] is True


def test_precondition_file(project: Path) -> None:
    model, _, _ = load_net(project)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 5)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), project / "adam.pt")
    cfg = _config(project, checkpoint="net.pt")
    out = project / "pre.parquet"
    frame = _run(
        cfg, "--ref", project / "ref.pt", "--precondition", project / "adam.pt", "--out", out
    )
    plain = _run(cfg, "--ref", project / "ref.pt", "--out", project / "plain.parquet")
    # the values themselves: tests/scorers/test_influence.py
    assert not frame["influence"].equals(plain["influence"])
    assert read_metadata(out)["influence"]["precondition"]["sha256"]


def test_user_errors_exit_2(project: Path, monkeypatch, capsys) -> None:
    cfg = _config(project, checkpoint="net.pt")
    ref = project / "ref.pt"
    monkeypatch.setattr(gradscope.scorers.influence, "MAX_PER_REF", 2)
    assert "at most 2 reference examples; REF has 3" in fails(
        monkeypatch, capsys, "influence", cfg, "--ref", ref, "--per-ref"
    )
    assert "engine must be one of" in fails(
        monkeypatch, capsys, "influence", cfg, "--ref", ref, "--engine", "fast"
    )
    assert "--ref file not found" in fails(
        monkeypatch, capsys, "influence", cfg, "--ref", project / "nope.pt"
    )
    other = torch.nn.Linear(5, 3)
    torch.save(torch.optim.Adam(other.parameters()).state_dict(), project / "other.pt")
    err = fails(
        monkeypatch, capsys, "influence", cfg, "--ref", ref, "--precondition", project / "other.pt"
    )
    assert "optimizer state has 2 parameters, the model has 4" in err
    both = _config(project, checkpoint="net.pt", checkpoints=[{"path": "net1.pt"}])
    assert "not both" in fails(monkeypatch, capsys, "influence", both, "--ref", ref)
    negative = _config(project, checkpoint=None, checkpoints=[{"path": "net1.pt", "weight": -1}])
    assert "weights must be finite, >= 0" in fails(
        monkeypatch, capsys, "influence", negative, "--ref", ref
    )
    missing = _config(project, checkpoint=None, checkpoints=[{"weight": 1}])
    assert "model.checkpoints[0].path" in fails(
        monkeypatch, capsys, "influence", missing, "--ref", ref
    )


# (id, REF's rows, the start of the error line, the key it names before ", in --ref")
BAD_REFS = [
    ("a-target-out-of-range", {"x": torch.randn(K, 5), "y": torch.tensor([0, 1, 5])},
     "target 5 is not a class id of the model's 3 outputs", "data.targets"),
    ("inputs-too-wide", {"x": torch.randn(K, 6), "y": torch.tensor([0, 1, 2])},
     "the model cannot take inputs of shape (3, 6)", "data.inputs"),
    ("targets-not-class-ids", {"x": torch.randn(K, 5), "y": torch.tensor([0.5, 1, 2])},
     "cross_entropy takes class ids as integers, got floats", "data.targets"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "message", "key"), [pytest.param(*c[1:], id=c[0]) for c in BAD_REFS]
)
def test_an_error_in_refs_rows_names_ref(project: Path, rows, message, key) -> None:
    config = _config(project)
    ref = project / "bad_ref.pt"
    torch.save(rows, ref)
    for args in (
        ["influence", str(config), "--ref", str(ref)],
        ["check", str(config), "--ref", str(ref)],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {message}"), line
        assert line.endswith(f"({key}, in --ref {ref})"), line
