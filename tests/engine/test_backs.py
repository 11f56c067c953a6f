"""The batched VJPs written out for the ops a computed tensor is made by (``engine/backs.py``):
each against ``torch.func``'s vjp under vmap in float64, and the weight-standardised
convolutions carried back by them alone, ``torch.func`` out of reach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from computed_models import Standardized, T
from oracle import assert_norms_through_one_engine, assert_rel_close
from torch import Tensor, nn

from gradscope.engine.backs import back_of

B = 3


def _standardize(x: Tensor, eps: float = 1e-5) -> Tensor:
    return F.batch_norm(x, None, None, training=True, momentum=0.0, eps=eps)


OPS = [
    ("batch-norm-weight", _standardize, (1, 6, 18)),
    ("batch-norm-eps", lambda x: _standardize(x, 0.5), (1, 4, 3)),
    ("batch-norm-images", _standardize, (2, 3, 4, 5)),
    ("reshape", lambda x: x.reshape(4, -1), (2, 6)),
    ("view", lambda x: x.view(3, 2, 2), (4, 3)),
    ("flatten", lambda x: x.flatten(1), (2, 3, 2)),
    ("unflatten", lambda x: x.unflatten(1, (2, 3)), (2, 6)),
    ("squeeze", lambda x: x.squeeze(0), (1, 5)),
    ("unsqueeze", lambda x: x.unsqueeze(1), (4, 2)),
    ("reshape-as", lambda x, o=torch.empty(3, 4): x.reshape_as(o), (2, 6)),
    ("view-as", lambda x, o=torch.empty(6): x.view_as(o), (2, 3)),
]


@pytest.mark.parametrize(("name", "op", "shape"), OPS, ids=[o[0] for o in OPS])
def test_written_out_matches_torch_func(name, op, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64) * 2 + 1
    out, vjp = torch.func.vjp(op, x)
    grads = torch.randn(B, *out.shape, dtype=torch.float64)
    (expected,) = torch.func.vmap(vjp)(grads)
    seen = {}

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.setdefault("call", (func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Seen():
        op(x)
    assert seen["call"][1][0] is x
    back = back_of(*seen["call"])
    assert back is not None
    assert_rel_close(back(grads), expected, 1e-12)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.view(torch.int64),  # reinterprets, not reshapes
        lambda x: F.batch_norm(x, None, None, training=False),  # no statistics of its own
        lambda x, w=torch.ones(6): F.batch_norm(x, None, None, w, training=True),  # an affine
        lambda x: x.exp(),
    ],
)
def test_others_have_none(call):
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    seen = {}

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.setdefault("call", (func, args, kwargs or {}))
            raise StopIteration

    with pytest.raises(StopIteration), Seen():
        call(x)
    func, args, _ = seen["call"]
    assert args[0] is x  # the op itself, not one making its other arguments
    assert back_of(*seen["call"]) is None


@pytest.mark.parametrize("batch", [1, 4])
def test_standardized_convolutions_without_torch_func(batch: int, monkeypatch):
    """Analysed, then replayed: every norm the float64 loop's, with ``torch.func`` refused (it
    carried each computed weight back before), no parameter on the fallback."""

    def refused(*args, **kwargs):
        raise AssertionError("torch.func called")

    torch.manual_seed(0)
    model = Standardized().double()
    x = torch.randn(batch, T, 3, dtype=torch.float64)
    y = torch.randn(batch, 3, dtype=torch.float64)
    monkeypatch.setattr(torch.func, "vjp", refused)
    monkeypatch.setattr(torch.func, "vmap", refused)
    engine = assert_norms_through_one_engine(model, [((x,), y)] * 3, "mse")
    assert engine.record.at((x,), y).replays == 2


class ScaledStandardized(nn.Module):
    """timm's ``ScaledStdConv2d`` in another order: the standardised weight, written out, then
    scaled by a gain per output channel, which ``torch.func`` carries back through the tensor
    the written-out ops made, and both parameters read by one convolution."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.gain = nn.Parameter(torch.rand(4) + 0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, 6, 6)
        w = _standardize(self.w.reshape(1, 4, -1)).reshape_as(self.w)
        h = F.conv2d(x, w * self.gain[:, None, None, None], padding=1)  # (B, 4, 6, 6)
        return self.head(torch.tanh(h).mean((2, 3)))


def test_a_standardised_weight_scaled_after():
    torch.manual_seed(0)
    model = ScaledStandardized().double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    engine = assert_norms_through_one_engine(model, [((x,), y)] * 3, "mse")
    assert engine.record.at((x,), y).replays == 2
