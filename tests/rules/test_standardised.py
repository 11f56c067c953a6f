"""BiT's weight-standardised convolutions and group norms with an activation, served by their
own rules (``rules/standardised.py``): exact against the float64 loop on odd shapes (one
example, groups, stride, dilation, dynamic "SAME" and fixed padding, a bias, few positions
and many, chunks of examples), each shape analysed once and replayed after, nothing on the
fallback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from oracle import assert_fallback, assert_rel_close, findings_by_shape, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss
from gradscope.rules import base, find_rule

bit = pytest.importorskip("transformers.models.bit.modeling_bit")
CLASSES = 3


class Net(nn.Module):
    """A stem of dynamic "SAME" padding at stride 2, a grouped, dilated convolution with a
    bias, a strided one of few positions (the Gram of the patches), BiT's norms between them
    (with ``act``, and without an activation)."""

    def __init__(self, act: str):
        super().__init__()
        config = SimpleNamespace(num_groups=2, hidden_act=act)
        self.stem = bit.WeightStandardizedConv2d(3, 8, 3, stride=2, padding="SAME", eps=1e-6)
        self.norm = bit.BitGroupNormActivation(config, 8)
        self.grouped = bit.WeightStandardizedConv2d(
            8, 8, 3, padding=2, dilation=2, groups=2, bias=True, eps=1e-8
        )
        self.plain = bit.BitGroupNormActivation(config, 8, apply_activation=False)
        self.few = bit.WeightStandardizedConv2d(8, 6, 3, stride=3, padding=0, eps=1e-8)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, H, W)
        h = self.plain(self.grouped(self.norm(self.stem(x))))
        return self.head(self.few(h).mean((2, 3)))  # (B, 6, 2, 2) -> (B, 3)


def _batch(seed: int, b: int, side: int) -> tuple[tuple[Tensor, ...], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 3, side, side, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (b,), generator=g)


SHAPES = [(3, 12), (3, 12), (1, 12), (1, 12), (4, 15), (4, 15)]


@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_standardised_rules_are_exact_and_replay(act, chunked, monkeypatch):
    if chunked:  # the convolutions' examples formed a few at a time
        monkeypatch.setattr(base, "CHUNK_ELEMENTS", 2000)
    torch.manual_seed(0)
    model = Net(act).double().eval()
    rules = {find_rule(m).name for m in model.modules() if find_rule(m) is not None}
    assert rules == {"standardised_conv", "group_norm_activation", "linear"}
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        for shape in SHAPES:
            x, y = _batch(SHAPES.index(shape), *shape)
            got = total(engine.norms(x, y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, x, y, "cross_entropy")[1], 1e-9)
    assert_fallback(engine)
    assert {p.rule for p in engine.plan.params} == rules
    findings_by_shape(engine, _batch, SHAPES)
