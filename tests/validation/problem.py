"""A tiny problem to retrain in tests: a 2-feature, 3-class logistic regression on 40 rows, 8
references, a few SGD steps; and the same recipe as a plain PyTorch loop, the tests' oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

MODEL_PY = """
from torch import nn


class Logistic(nn.Linear):
    def __init__(self):
        super().__init__(2, 3)
"""
ROWS, REFS = 40, 8
TRAIN = {"optimizer": "sgd", "lr": 0.5, "epochs": 2, "batch_size": 10, "seed": 3}


def make_problem(root: Path, **train) -> Path:
    """model.py, data.pt (x, y, flipped), ref.pt and config.yaml under ``root``; the config."""
    (root / "model.py").write_text(MODEL_PY)
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]], dtype=torch.float64)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 3, (n,), generator=g)
        return centres[y] + torch.randn(n, 2, generator=g, dtype=torch.float64), y

    x, y = draw(ROWS)
    flipped = torch.zeros(ROWS, dtype=torch.bool)
    flipped[::8] = True  # 5 labels moved to the next class
    y = torch.where(flipped, (y + 1) % 3, y)
    torch.save({"x": x, "y": y, "flipped": flipped}, root / "data.pt")
    rx, ry = draw(REFS)
    torch.save({"x": rx, "y": ry}, root / "ref.pt")
    cfg = {
        "model": {"factory": "model.py:Logistic"},
        "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": 16},
        "loss": {"name": "cross_entropy"},
        "device": "cpu",
        "dtype": "float64",
        "train": TRAIN | train,
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def oracle_fit(
    root: Path, rows: np.ndarray, seed: int, weights: np.ndarray | None = None
) -> torch.nn.Linear:
    """TRAIN's recipe by hand: the factory's initialisation under ``seed``, each epoch a new
    order of ``rows`` drawn from a generator seeded with ``seed``, SGD on the batch mean (of
    each row's loss times its weight, when ``weights`` gives one per row of ``rows``)."""
    data = torch.load(root / "data.pt")
    x, y = data["x"][rows], data["y"][rows]
    w = torch.ones(len(rows), dtype=x.dtype) if weights is None else torch.as_tensor(weights)
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=TRAIN["lr"])
    order = torch.Generator().manual_seed(seed)
    for _ in range(TRAIN["epochs"]):
        for idx in torch.randperm(len(rows), generator=order).split(TRAIN["batch_size"]):
            opt.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
            (losses * w[idx]).mean().backward()
            opt.step()
    return model.eval()


def ref_targets(root: Path, model: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """(R,) each reference's loss and margin under ``model``, computed here."""
    ref = torch.load(root / "ref.pt")
    with torch.no_grad():
        logits = model(ref["x"])
    loss = torch.nn.functional.cross_entropy(logits, ref["y"], reduction="none")
    mine = logits.gather(1, ref["y"][:, None])[:, 0]
    others = logits.scatter(1, ref["y"][:, None], -torch.inf).amax(1)
    return loss.numpy(), (mine - others).numpy()
