"""Intercepted reads (``replay/intercept.py``) through the public paths: a ViT-like model (a
class token and a position table read at its top level, ``nn.MultiheadAttention`` called twice)
on batches of one shape with other values, by a fresh ``per_example_norms`` call each, by
``gradscope.norms`` and by the command line over batches that replay, each against the float64
per-example loop, the model left as it was."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
import yaml
from oracle import assert_rel_close, model_state, reference_norms
from test_intercept import CLASSES, TinyViT
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app

B, BATCHES = 3, 3
MODEL_PY = f"""
import sys
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[2])!r}]
from test_intercept import TinyViT as Net
"""


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, 6, generator=g, dtype=torch.float64), torch.arange(B) % CLASSES


def _model() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT().double()


def _want(model: TinyViT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return reference_norms(model, (x,), y, "cross_entropy")[1]


def test_fresh_calls_on_two_batches_equal_the_loop_and_keep_the_model():
    model = _model()
    for seed in (1, 2):  # one shape, other values
        x, y = _batch(seed)
        state = model_state(model)
        got = gradscope.per_example_norms(model, x, y)
        state.assert_kept(model)
        assert_rel_close(got, _want(model, x, y), 1e-9)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    batches = [_batch(seed) for seed in range(1, BATCHES + 1)]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def test_a_run_whose_later_batches_replay_equals_the_loop_and_keeps_the_model(intercepted):
    model, (x, y) = _model(), _rows()
    state = model_state(model)
    scores = gradscope.norms(model, {"x": x, "y": y}, inputs="x", targets="y", batch_size=B)
    state.assert_kept(model)
    assert intercepted and all(intercepted)  # the later batches replayed, intercepting
    got = torch.tensor(scores.sort_values("example_id")["grad_norm"].to_numpy())
    assert_rel_close(got, _want(model, x, y), 1e-9)


def test_the_command_line_equals_the_loop_over_batches_that_replay(tmp_path: Path, intercepted):
    (tmp_path / "model.py").write_text(MODEL_PY)
    model, (x, y) = _model(), _rows()
    torch.save({"x": x, "y": y}, tmp_path / "data.pt")
    torch.save(model.state_dict(), tmp_path / "net.pt")
    config = {"model": {"factory": "model.py:Net", "checkpoint": "net.pt"},
              "data": {"path": "data.pt", "inputs": "x", "targets": "y", "batch_size": B},
              "loss": {"name": "cross_entropy"}, "device": "cpu", "dtype": "float64",
              "output": {"path": "scores.parquet"}}  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["norms", str(tmp_path / "config.yaml")])
    assert result.exit_code == 0, result.output
    assert intercepted and all(intercepted)
    got = torch.tensor(pd.read_parquet(tmp_path / "scores.parquet")["grad_norm"].to_numpy())
    assert_rel_close(got, _want(model, x, y), 1e-9)
