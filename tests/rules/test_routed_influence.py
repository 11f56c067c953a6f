"""The routed experts' inner products by each row's own expert (float32 on the CPU, the path
``rules/routed.py``'s ``routed_inners`` takes) through the public paths: two batches of one shape
with other values, a fresh ``per_example_influence`` call each and the command line, each
against the float64 per-example loop, the model left as it was."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
import yaml
from moe_models import Block, Experts, H, LoopExperts
from oracle import assert_fallback, assert_rel_close, model_state, reference_influence
from torch import Tensor, nn
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app

B, T, C = 4, 5, 3
MODEL_PY = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
import torch
from torch import nn
from moe_models import Block, Experts


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = Block(Experts()), nn.Linear({H}, {C})

    def forward(self, x):
        return self.head(self.block(x).mean(1))
"""


class Net(nn.Module):
    """A router, its experts (grouped), a head over the positions' mean: float32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head = Block(Experts()), nn.Linear(H, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(x).mean(1))


def _loop(model: Net) -> Net:
    """The same weights with transformers' eager experts, which float64 runs (grouped_mm does
    not): the loop's model."""
    oracle = Net()
    oracle.block.experts = LoopExperts()
    oracle.load_state_dict(model.state_dict(), strict=False)  # its unused bias stays 0
    return oracle


def _want(model: Net, x: Tensor, y: Tensor, ref: tuple[Tensor, Tensor]) -> Tensor:
    want, _, _ = reference_influence(_loop(model), (x,), y, ((ref[0],), ref[1]), "cross_entropy")
    return want[:, 0]


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=g), torch.randint(0, C, (B,), generator=g)


def test_two_batches_fresh_calls_equal_the_loop_and_keep_the_model():
    model = Net()
    ref = _batch(9)
    for seed in (1, 2):  # one shape, other values
        x, y = _batch(seed)
        state = model_state(model)
        got = gradscope.per_example_influence(model, x, y, ref[0], ref[1], curvature="none")
        state.assert_kept(model)
        assert_rel_close(got, _want(model, x, y, ref), 1e-4)  # float32 against float64
    assert_fallback(model)


def test_the_command_line_equals_the_loop_on_two_batches(tmp_path: Path):
    (tmp_path / "model.py").write_text(MODEL_PY)
    (x1, y1), (x2, y2), ref = _batch(1), _batch(2), _batch(9)
    torch.save({"x": torch.cat([x1, x2]), "y": torch.cat([y1, y2])}, tmp_path / "data.pt")
    torch.save({"x": ref[0], "y": ref[1]}, tmp_path / "ref.pt")
    model = Net()
    torch.save(model.state_dict(), tmp_path / "net.pt")
    config = {"model": {"factory": "model.py:Net", "checkpoint": "net.pt"},
              "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": B},
              "loss": {"name": "cross_entropy"}, "device": "cpu",
              "output": {"path": "scores.parquet"}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    args = ["influence", str(tmp_path / "config.yaml"), "--ref", str(tmp_path / "ref.pt"),
            "--curvature", "none", "--engine", "hooks"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    got = torch.tensor(pd.read_parquet(tmp_path / "scores.parquet")["influence"].to_numpy())
    assert_rel_close(got, _want(model, torch.cat([x1, x2]), torch.cat([y1, y2]), ref), 1e-4)
