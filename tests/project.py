"""A small project on disk (model file, checkpoint, data, config) for end-to-end tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

MODEL_PY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 8, classes: int = 3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class TupleNet(Net):
    def forward(self, x):
        return super().forward(x), x


class Columns(Net):
    """Five scalar columns (a CSV table) as five inputs."""

    def forward(self, *columns):
        return super().forward(torch.stack(columns, 1))


def make_dataset():
    g = torch.Generator().manual_seed(1)
    return {"features": torch.randn(9, 5, generator=g), "label": torch.randint(0, 3, (9,), generator=g)}
'''


def make_project(root: Path, n: int = 23, **config: Any) -> Path:
    """Write model.py, net.pt, data.pt and config.yaml under ``root``; returns the config path."""
    (root / "model.py").write_text(MODEL_PY)
    g = torch.Generator().manual_seed(0)
    state = {
        "fc1.weight": torch.randn(8, 5, generator=g),
        "fc1.bias": torch.randn(8, generator=g),
        "fc2.weight": torch.randn(3, 8, generator=g),
        "fc2.bias": torch.randn(3, generator=g),
    }
    torch.save(state, root / "net.pt")
    x = torch.randn(n, 5, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.save({"x": x, "y": y, "name": torch.arange(100, 100 + n)}, root / "data.pt")
    cfg = {
        "model": {"factory": "model.py:Net", "checkpoint": "net.pt"},
        "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": 4},
        "device": "cpu",
        "output": {"path": "scores.parquet"},
    }
    for key, value in config.items():
        section, _, name = key.partition("__")
        if name:
            cfg.setdefault(section, {})[name] = value
        else:
            cfg[section] = value
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def load_net(root: Path) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The project's model with its checkpoint, and its data, for the oracle."""
    from gradscope.io.model import import_object

    net = import_object(f"{root / 'model.py'}:Net", "test")()
    net.load_state_dict(torch.load(root / "net.pt"))
    data = torch.load(root / "data.pt")
    return net, data["x"], data["y"]
