"""Fine-tuned models: the parameters that require grad are scored by default, peft adapters
loaded from a folder (model.adapter), half precision from the config; each against the float64
per-example loop."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import yaml
from oracle import assert_rel_close, reference_influence, reference_norms
from torch import nn
from typer.testing import CliRunner

import gradscope
from gradscope.cli import app
from gradscope.engine.core import Engine
from gradscope.engine.plan import build_plan
from gradscope.errors import ConfigError
from gradscope.io.parquet import read_metadata
from gradscope.losses import resolve_loss

runner = CliRunner()


def frozen_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 MLP whose first layer is frozen, and a batch for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].requires_grad_(False)
    return model, torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


def test_the_parameters_that_require_grad_by_default():
    model, x, y = frozen_mlp()
    plan = build_plan(model)
    assert plan.selection == "trainable"
    assert [p.name for p in plan.included] == ["2.weight", "2.bias"]
    got = gradscope.per_example_norms(model, x, y)
    _, expected = reference_norms(model, (x,), y, "cross_entropy", include=["2.*"])
    assert_rel_close(got, expected, 1e-9)
    # the frozen layer's flags are read before the engine flips them, and restored after
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert build_plan(model).selection == "trainable"


def test_all_parameters_when_none_requires_grad():
    model, x, y = frozen_mlp()
    model.requires_grad_(False)  # loaded for inference
    plan = build_plan(model)
    assert plan.selection == "all" and len(plan.included) == 4
    got = gradscope.per_example_norms(model, x, y)
    _, expected = reference_norms(model, (x,), y, "cross_entropy", include=["*"])
    assert_rel_close(got, expected, 1e-9)
    assert not any(p.requires_grad for p in model.parameters())


def test_include_picks_frozen_parameters_too():
    model, x, y = frozen_mlp()
    plan = build_plan(model, ["0.*"])
    assert plan.selection == "include" and [p.name for p in plan.included] == ["0.weight", "0.bias"]
    got = gradscope.per_example_norms(model, x, y, include=["*"], exclude=["2.bias"])
    model.requires_grad_(True)
    _, expected = reference_norms(model, (x,), y, "cross_entropy", include=["*"], exclude=["2.bias"])
    assert_rel_close(got, expected, 1e-9)


def test_influence_over_the_trainable_parameters():
    model, x, y = frozen_mlp()
    ref = (torch.randn(3, 6, dtype=torch.float64),), torch.randint(0, 3, (3,))
    got = gradscope.per_example_influence(model, x, y, *ref)
    expected, _, _ = reference_influence(model, (x,), y, ref, "cross_entropy", exclude=("0.*",))
    assert_rel_close(got, expected[:, 0], 1e-9)


def test_exclude_that_leaves_no_trainable_parameter_is_named():
    model, _, _ = frozen_mlp()
    with pytest.raises(ConfigError, match="leaves none of the parameters that require grad"):
        Engine(model, resolve_loss("cross_entropy"), exclude=["2.*"])
