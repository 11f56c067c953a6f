"""`gradscope norms` and `gradscope influence --ref` on routed experts, each batch after the
first of its shape replayed (counted: ``project.count_passes``), none on the
fallback, the Parquet's numbers the per-example loop's: experts run by ``grouped_mm`` whose
Gram over all rows costs more than the read (``Routed.keyed``, forced here on tiny experts:
each (example, expert) key's rows apart; float32, which ``grouped_mm`` takes alone on the CPU),
and Ergo's experts that pick their rows by a boolean mask (float64, models of three seeds)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from moe_models import Block, Experts, H
from oracle import assert_rel_close, reference_norms
from project import count_passes, invoke_cli, saved_model
from torch import Tensor, nn

from gradscope.engine import Engine, naive_grads
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss
from gradscope.rules import routed
from gradscope.rules.routed import Routed
from tests.engine.replay.test_masked_experts import F_IN
from tests.engine.replay.test_masked_experts import Model as Masked

N, REFS, BATCH, T, CLASSES = 10, 2, 3, 5, 3  # batches of 3, 3, 3 and 1
HELD: list[nn.Module] = []  # the model the config's factory hands the CLI


def held() -> nn.Module:
    return HELD[0]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(H, H), Block(Experts()), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, H)
        return self.head(self.block(self.inp(x)).mean(1))


def _run(root: Path, model: nn.Module, features: int, monkeypatch, *command: str) -> dict:
    """The CLI's ``command`` on ``model`` over data.pt (ref.pt beside it) of ``features`` in
    the model's dtype: the passes analysed and replayed."""
    dtype = next(model.parameters()).dtype
    for name, (n, seed) in {"data": (N, 1), "ref": (REFS, 2)}.items():
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, T, features, generator=g, dtype=dtype)
        torch.save({"x": x, "y": torch.randint(0, CLASSES, (n,), generator=g)}, root / f"{name}.pt")
    passes = count_passes(monkeypatch)
    HELD[:] = [model]
    section = saved_model(root, model, f"{__name__}:held")
    data = {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": BATCH}
    dtype = str(dtype).removeprefix("torch.")
    result = invoke_cli(root, section, data, "cross_entropy", *command, dtype=dtype)
    assert result.exit_code == 0, result.output
    plan = read_metadata(root / "scores.parquet")["plan"]
    assert plan and not [p["name"] for p in plan if p["rule"].startswith(("fallback", "excl"))]
    return passes


def _grads(model: nn.Module, data: dict) -> Tensor:
    """(n, P) each example's gradient, by the loop, one example at a time."""
    fn = resolve_loss("cross_entropy")
    with Engine(model, fn) as engine:
        names = [p.name for p in engine.plan.included]
    _, grads = naive_grads(model, (data["x"],), data["y"], fn, names)
    return torch.cat([g.flatten(1).double() for g in grads.values()], 1)


@pytest.mark.parametrize("command", ["norms", "influence"])
def test_keyed_experts_are_the_loops_and_replay(tmp_path: Path, command: str, monkeypatch):
    monkeypatch.setattr(routed, "ROUTED_COST", 0)  # no Gram over all rows cheap: keyed
    monkeypatch.setattr(routed, "ROUTED_FLOPS", 0)
    keyed, made = [], Routed.__init__

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        keyed.append(self.keyed)

    monkeypatch.setattr(Routed, "__init__", kept)
    torch.manual_seed(0)
    model = Model().eval()
    args = ("--ref", str(tmp_path / "ref.pt"), "--curvature", "none")
    line = (command, *args) if command == "influence" else (command,)
    passes = _run(tmp_path, model, H, monkeypatch, *line)
    # (3, 5) replayed twice; (1, 5) analysed; influence's reference batch (2, 5) analysed too,
    # its gradient kept as each layer's factors where they cost less (``rules/factored.py``)
    analysed = 3 if command == "influence" else 2
    assert passes == {"analysed": analysed, "replayed": 2}
    assert keyed and all(keyed)
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    grads = _grads(model, torch.load(tmp_path / "data.pt"))  # (N, P)
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), grads.norm(dim=1), 1e-5)
    if command == "influence":
        ref = _grads(model, torch.load(tmp_path / "ref.pt")).mean(0)  # (P,)
        assert_rel_close(torch.tensor(frame["influence"].to_numpy()), grads @ ref, 1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_experts_are_the_loops_and_replay(tmp_path: Path, seed: int, monkeypatch):
    torch.manual_seed(seed)
    model = Masked().double().eval()
    passes = _run(tmp_path, model, F_IN, monkeypatch, "norms")
    assert passes == {"analysed": 2, "replayed": 2}
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    data = torch.load(tmp_path / "data.pt")
    _, norm = reference_norms(model, (data["x"],), data["y"], "cross_entropy")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-9)
