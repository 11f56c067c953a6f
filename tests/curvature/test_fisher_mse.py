"""The true Fisher of mse is its Gauss-Newton matrix: the sampled targets' output gradients have
the output Hessian's second moment (2/D I, mean over D elements; 2 I, sum), and on one Linear
layer with one output K-FAC's S (x) A is the dense GGN exactly."""

from __future__ import annotations

import pytest
import torch
from exact_oracle import curvature_matrix
from torch import nn
from torch.func import grad, hessian

from gradscope.curvature.factors import fit
from gradscope.curvature.fisher import SampledLoss
from gradscope.engine import Engine
from gradscope.losses import resolve_loss


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(1,), (3,), (2, 3)], ids=["one", "three", "2x3"])
def test_sampled_output_gradients_have_the_output_hessian(shape, reduction) -> None:
    loss = resolve_loss("mse", token_reduction=reduction)
    out = torch.randn(4000, *shape, dtype=torch.float64)
    sampled = SampledLoss("mse", loss, {}, -1, seed=7, token_reduction=reduction)
    targets = sampled.sample(out, torch.zeros_like(out))
    g = torch.stack(
        [grad(lambda o, i=i: loss(o[None], targets[i : i + 1])[0])(out[i]) for i in range(8)]
    )
    d = out[0].numel()
    h = hessian(lambda o: loss(o[None], targets[:1])[0])(out[0]).reshape(d, d)
    scale = 2 / d if reduction == "mean" else 2.0
    torch.testing.assert_close(h, scale * torch.eye(d, dtype=torch.float64))
    # g = scale x (random signs): g g^T has the Hessian's diagonal on every draw, and its
    # expectation is scale x E[r r^T] = the Hessian (independent fair signs)
    torch.testing.assert_close(g.square(), torch.full_like(g, scale))
    signs = (targets - out).flatten(1).sign()  # (N, D)
    assert torch.equal(signs.abs(), torch.ones_like(signs))
    second = signs.T @ signs / len(signs)  # -> I
    torch.testing.assert_close(second, torch.eye(d, dtype=torch.float64), atol=0.06, rtol=0)


def test_kfac_of_one_layer_is_the_dense_ggn() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randn(30, 1, dtype=torch.float64)
    loss = resolve_loss("mse")
    engine = Engine(model, SampledLoss("mse", loss, {}, -1))
    with engine:
        blocks, _, _ = fit(engine.contributions, lambda: [((x[:13],), y[:13]), ((x[13:],), y[13:])])
    names = ["weight", "bias"]
    ggn = curvature_matrix(model, loss, names, x, y, "gn")  # (5, 5)
    w = blocks["weight"].tensors
    torch.testing.assert_close(torch.kron(w["S"][0], w["A"][0]), ggn[:4, :4], rtol=1e-12, atol=0)
    torch.testing.assert_close(blocks["bias"].tensors["diagonal"], ggn[4:, 4].reshape(1))
