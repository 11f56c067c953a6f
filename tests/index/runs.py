"""Run ``gradscope index`` and ``query`` on make_project's model, and the loop they answer to."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from oracle import projected
from project import fails, load_net
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.engine import naive_grads
from gradscope.index.projection import factor
from gradscope.losses import resolve_loss

N, K = 10, 3  # examples (batches of 4) and reference examples


def run(*args: object) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def index(project: Path, *args: object, name: str = "ix") -> Path:
    out = project / name
    assert "wrote" in run("index", project / "config.yaml", "--out", out, *args)
    return out


def query(project: Path, ix: Path, *args: object, name: str = "q.parquet") -> pd.DataFrame:
    out = project / name
    run("query", ix, "--ref", project / "ref.pt", "--config", project / "config.yaml", "--out", out,
        *args)  # fmt: skip
    return pd.read_parquet(out)


def refused(monkeypatch, capsys, project: Path, ix: Path, *args: object) -> str:
    """``query IX`` with the project's REF and config, ended by one ``error:`` line."""
    return fails(monkeypatch, capsys, "query", ix, "--ref", project / "ref.pt", "--config",
                 project / "config.yaml", "--out", project / "q.parquet", *args)  # fmt: skip


def loop(project: Path) -> tuple[dict, dict]:
    """{name: (N, *shape)} the examples' and {name: (K, *shape)} the references' gradients."""
    net, x, y = load_net(project)
    net.double().eval()
    ref = torch.load(project / "ref.pt")
    loss, names = resolve_loss("cross_entropy"), [n for n, _ in net.named_parameters()]
    _, grads = naive_grads(net, (x.double(),), y, loss, names)
    _, refs = naive_grads(net, (ref["x"].double(),), ref["y"], loss, names)
    return grads, refs


def projected_loop(project: Path, ix: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, width) and (K, width): the loop's gradients projected by the index's own factors
    (drawn from its manifest's seed), each block as the definition writes it."""
    blocks = manifest(ix)["projection"]["blocks"]
    seed = manifest(ix)["projection"]["seed"]
    grads, refs = loop(project)
    phi, psi = [], []
    for b in blocks:
        rows, cols = math.prod(b["shape"][: b["split"]]), math.prod(b["shape"][b["split"] :])
        p_out, p_in = (
            None if f is None else f.double()
            for f in (factor(seed, b["name"], "out", rows, b["k_out"]),
                      factor(seed, b["name"], "in", cols, b["k_in"]))
        )  # fmt: skip
        phi.append(projected(grads[b["name"]], b["split"], p_out, p_in))
        psi.append(projected(refs[b["name"]], b["split"], p_out, p_in))
    return torch.cat(phi, 1), torch.cat(psi, 1)


def manifest(ix: Path) -> dict:
    return json.loads((ix / "manifest.json").read_text())


def close(actual, expected, rtol: float) -> None:
    actual, expected = np.asarray(actual, dtype=float), np.asarray(expected, dtype=float)
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= rtol * scale, (actual, expected)
