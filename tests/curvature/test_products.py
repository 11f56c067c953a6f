"""The curvature products' own choices against torch.func in float64: attention through its
composite kernel (the fused ones have no forward mode), the directions vmapped per chunk sized
by the activations the forward counted, and the power iteration's stop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from exact_oracle import curvature_matrix
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gradscope.curvature import products
from gradscope.curvature.exact import dense_matrix, largest_eigenvalue
from gradscope.curvature.products import Products
from gradscope.engine import Engine
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss


class Attention(nn.Module):
    """One head of causal self-attention over 4 positions of width 3, then a readout."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(3, 9), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 4, 3) -> (B, 2)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # (B, 1, 4, 3) each
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0, -1])


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def data(shape: tuple, classes: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, classes, shape[:1], generator=g)  # fmt: skip


@pytest.mark.parametrize("kind", ["gn", "hessian"])
def test_attention_curvature_equals_the_definition(kind: str) -> None:
    torch.manual_seed(0)
    model, (x, y) = Attention().double(), data((6, 4, 3), 2)
    loss = resolve_loss("cross_entropy")
    names = [n for n, _ in model.named_parameters()]
    with Engine(model, loss) as engine:
        got = dense_matrix(Products(engine, lambda: [((x,), y)], kind))
    with sdpa_kernel([SDPBackend.MATH]):  # the oracle's Hessian is forward over reverse too
        expected = curvature_matrix(model, loss, names, x, y, kind)
    torch.testing.assert_close(got, (expected + expected.T) / 2, rtol=1e-6, atol=1e-12)


def test_the_chunk_is_sized_by_the_forward_s_activations(monkeypatch) -> None:
    """Every module's outputs counted (fc1 4, fc2 3, the model's 3 per example); any chunk
    gives the same products, one direction at a time included."""
    torch.manual_seed(0)
    model, (x, y) = MLP().double(), data((7, 5), 3)
    block = torch.randn(39, 5, dtype=torch.float64)  # (P, K): the MLP has 39 parameters
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        made = Products(engine, lambda: [((x,), y)])
        whole = made(block)
        assert made.per_example * 7 == 7 * (4 + 3 + 3)
        monkeypatch.setattr(products, "CHUNK_ELEMENTS", 70 + 39)  # one direction per chunk
        torch.testing.assert_close(made(block), whole, rtol=1e-12, atol=1e-14)


def test_the_power_iteration_stops_once_settled() -> None:
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    values = torch.linspace(0.0, 1.0, 50, dtype=torch.float64) ** 4 * 3.0  # max 3, gap 8%
    matrix = q @ torch.diag(values) @ q.T
    assert largest_eigenvalue(matrix) == pytest.approx(3.0, rel=1e-5)
    assert largest_eigenvalue(matrix, steps=2) < 3.0 * (1 - 1e-5)  # it did not stop early


@pytest.mark.parametrize("kind", ["gn", "hessian"])
def test_a_model_torch_func_cannot_run_is_one_line_naming_the_other_curvatures(kind) -> None:
    """weight_norm's kernel has no forward-mode derivative: a traceback from inside torch.func
    before, the default curvature included."""
    torch.manual_seed(0)
    model, (x, y) = MLP().double(), data((7, 5), 3)
    nn.utils.parametrizations.weight_norm(model.fc1)
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        made = Products(engine, lambda: [((x,), y)], kind)
        with pytest.raises(ModelError, match=r"torch\.func, which cannot run it: .*kfac, ekfac"):
            made(torch.randn(made.flat.size, 2, dtype=torch.float64))
