"""A selected parameter that no row's gradient reaches (a layer the forward never calls): its
K-FAC / EK-FAC curvature is zero, so it scores nothing, as with the parameter left out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gradscope


class Unreached(nn.Module):
    """An MLP beside a Linear its forward never calls."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.unused = nn.Linear(5, 4), nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _rows(n: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 5, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


KW = {"inputs": "x", "targets": "y", "loss": "cross_entropy", "batch_size": 4}


@pytest.mark.parametrize("curvature", ["kfac", "ekfac"])
def test_a_parameter_no_row_reaches_scores_as_left_out(curvature: str) -> None:
    torch.manual_seed(0)
    model, data, ref = Unreached().double(), _rows(10, 1), _rows(3, 2)
    got = gradscope.influence(model, data, ref=ref, curvature=curvature, **KW)
    want = gradscope.influence(
        model, data, ref=ref, curvature=curvature, exclude=["unused.*"], **KW
    )
    np.testing.assert_allclose(got.influence, want.influence, rtol=1e-12)


def test_factors_of_a_config_fit_that_config(tmp_path) -> None:
    """The factors file of a model with an unreached parameter preconditions that model (it
    was refused as not fitting its parameters)."""
    torch.manual_seed(0)
    model, data, ref = Unreached().double(), _rows(10, 1), _rows(3, 2)
    made = gradscope.factors(model, data, out=tmp_path / "f.safetensors", ekfac=True, **KW)
    assert made.blocks["unused.weight"].tensors["diagonal"].abs().sum() == 0
    got = gradscope.influence(model, data, ref=ref, precondition=tmp_path / "f.safetensors", **KW)
    want = gradscope.influence(model, data, ref=ref, curvature="ekfac", **KW)
    np.testing.assert_allclose(got.influence, want.influence, rtol=1e-12)
