"""The attribution benchmark's runner still runs: a tiny setting trained (and recorded), scored by
gradscope's commands (an ensemble over the epoch checkpoints among them), validated on both truths and rendered; a peer's matrix written as a score file reads back
to the same LDS as the gradscope file it came from."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "attribution"))
import run  # noqa: E402  benchmarks/attribution/run.py
from scorers import write_scores  # noqa: E402

from gradscope.config import load_config  # noqa: E402
from gradscope.io.parquet import read_metadata  # noqa: E402

DATA = run.HERE / "data"
DESIGNS = [
    {"name": "halves", "subsets": 4, "seeds": 1, "fraction": 0.5, "same_order": False},
    {"name": "same-order", "subsets": 4, "seeds": 1, "fraction": 0.9, "same_order": True},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[run.Bench, dict]:
    """Logistic regression on 40 digits, 4 references, two epochs: measured once."""
    tmp = tmp_path_factory.mktemp("tiny")
    train = torch.load(DATA / "digits_train.pt", weights_only=True)
    ref = torch.load(DATA / "digits_ref.pt", weights_only=True)
    torch.save({"x": train["x"][:40].clone(), "y": train["y"][:40].clone()}, tmp / "train.pt")
    torch.save({"x": ref["x"][:4].clone(), "y": ref["y"][:4].clone()}, tmp / "ref.pt")
    raw = yaml.safe_load((run.HERE / "configs/digits_linear.yaml").read_text())
    raw["model"]["checkpoint"] = str(tmp / "work" / "model.pt")
    raw["data"] |= {"path": str(tmp / "train.pt"), "batch_size": 40}
    raw["output"]["path"] = str(tmp / "work" / "scores.parquet")
    raw["train"] |= {"epochs": 2, "batch_size": 20, "save_every": 1}
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(raw))
    bench = run.Bench(tmp / "tiny.yaml", tmp / "ref.pt", ("gn",), (0.1,), cg=((0.1, 1e-2),))
    return bench, run.measure(bench, DESIGNS, None)


def test_the_runner_scores_validates_and_renders_a_tiny_setting(tiny):
    _, measured = tiny
    runs = measured["scorers"]
    kinds = [(r["scorer"], r["options"].get("curvature")) for r in runs]
    assert kinds == [("through-training", None), ("influence", None), ("influence", "none"),
                     ("cosine", "none"), ("tracin", None), ("influence", "gn"),
                     ("influence", "gn"), ("ensemble", None), ("ensemble", "gn")]  # fmt: skip
    assert all(r["status"] == "ok" and r["seconds"] > 0 for r in runs), runs
    for name in ("halves", "same-order"):
        assert all(-1 <= r["lds"][name]["lds"] <= 1 for r in runs)
        assert all(r["lds"][name]["references"] == 4 for r in runs)
    assert measured["rows"] == 40 and 0 <= measured["ref_accuracy"] <= 1
    assert measured["replay_mean_s"] > 0 and set(measured["truth_s"]) == {"halves", "same-order"}
    settings = {"tiny": measured}
    text = run.markdown({"environment": run.environment(None), "designs": DESIGNS, "settings": settings})  # fmt: skip
    assert "| gradscope `--curvature gn`, best damping |" in text
    cg = runs[6]  # its note what the solve reached, as the file's metadata says
    assert cg["options"] == {"solver": "cg", "cg_tolerance": 0.01, "curvature": "gn",
                             "damping": 0.1}  # fmt: skip
    (fit,) = read_metadata(cg["file"])["influence"]["curvatures"]
    assert 0 < fit["residual"] <= 1e-2 and fit["tolerance"] == 1e-2
    assert cg["note"] == (f"conjugate gradients: {fit['iterations']} iterations, relative "
                          f"residual {fit['residual']:.1e} (tolerance 0.01)")  # fmt: skip
    assert "| gradscope `--curvature gn --solver cg --cg-tolerance 0.01 --damping 0.1` |" in text
    assert (
        "| gradscope ensemble over the epoch checkpoints, `--curvature gn`, best damping |" in text
    )
    assert "LDS on the same-order truth" in text and "`--through-training`" in text
    plain = runs[2]["lds"]
    assert f"| {plain['halves']['lds']:.3f} ({plain['halves']['lds_std']:.3f}) |" in text


def test_a_peer_matrix_reads_back_as_the_scores_it_holds(tiny):
    bench, _ = tiny
    cfg = load_config(bench.config)
    work = Path(cfg.model.checkpoint).parent
    frame = pd.read_parquet(work / "plain.parquet")
    matrix = np.zeros((4, 40))  # (R, N)
    matrix[frame["ref_id"], frame["example_id"]] = frame["influence"]
    write_scores(matrix, cfg, str(bench.ref), work / "peer.parquet", {"tool": "test"}, 1.5)
    files = [str(work / "plain.parquet"), str(work / "peer.parquet")]
    _, results = run.validate(work / "config.yaml", bench, files, "influence", work, DESIGNS[0])
    plain, peer = (r for r in results if r["column"] == "influence")
    assert peer["seconds"] == 1.5
    assert math.isclose(peer["lds"], plain["lds"], abs_tol=1e-12)


def test_only_keeps_the_runs_its_patterns_match(tiny):
    _, measured = tiny
    runs = [run.Run(**r) for r in measured["scorers"]]
    keys = [run.key(r) for r in runs if run.chosen(r, ["gradscope:ensemble:*", "*damping=0.1"])]
    assert keys == ["gradscope:influence:curvature=gn,damping=0.1",
                    "gradscope:influence:solver=cg,cg_tolerance=0.01,curvature=gn,damping=0.1",
                    "gradscope:ensemble:checkpoints=epochs",
                    "gradscope:ensemble:checkpoints=epochs,curvature=gn,damping=0.1"]  # fmt: skip
    assert all(run.chosen(r, []) for r in runs)
    assert all(r.cpu_s > 0 and r.commit for r in runs)


def test_a_merge_replaces_the_rows_it_measured_and_keeps_the_rest(tiny):
    _, measured = tiny
    rows = [{k: v for k, v in r.items() if k != "commit"} for r in measured["scorers"]]
    old = measured | {"scorers": rows}  # as a report from before rows named their commit
    again = measured["scorers"][5] | {"seconds": 0.5, "commit": "new"}  # gn at 0.1
    new = measured | {"scorers": [again], "truth_s": None, "train_s": 99.0}
    made = run.merged(old, new, "old")
    assert [r["commit"] for r in made["scorers"]] == ["old"] * 5 + ["new"] + ["old"] * 3
    assert made["scorers"][5]["seconds"] == 0.5 and made["truth_s"] == measured["truth_s"]
    assert made["train_s"] == measured["train_s"]
    text = run.markdown({"environment": {**run.environment(None), "commit": "new"},
                         "designs": DESIGNS, "settings": {"tiny": made}})  # fmt: skip
    assert "@old" in text and "| new |" in text


def test_the_probe_solves_every_damping_from_one_krylov_space():
    """``cg_probe.multishift``: each shift's kept iterate at its tolerance, against the solve of
    its own system: the residual within the tolerance, the error within what it allows."""
    from cg_probe import multishift

    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(60, 60, generator=g, dtype=torch.float64))[0]
    c = (q * torch.logspace(-4, 1, 60, dtype=torch.float64)) @ q.T  # (P, P) PSD
    b = torch.randn(60, 3, generator=g, dtype=torch.float64)  # (P, K)
    base, found = 0.01, {}
    multishift(lambda v: c @ v + base * v, b, [0.0, 0.02, 0.09], [1e-2, 1e-8],
               lambda s, t, it, x: found.setdefault((s, t), (it, x.clone())))  # fmt: skip
    assert len(found) == 6
    for (shift, tolerance), (iterations, x) in found.items():
        lam = base + shift
        damped = c + lam * torch.eye(60, dtype=torch.float64)
        residual = (b - damped @ x).norm(dim=0) / b.norm(dim=0)
        assert (residual <= tolerance * 1.01).all() and iterations > 0
        error = (x - torch.linalg.solve(damped, b)).norm(dim=0)
        assert (error <= residual * b.norm(dim=0) / lam * 1.01).all()
    assert found[0.09, 1e-2][0] < found[0.0, 1e-2][0]  # the larger damping, sooner
