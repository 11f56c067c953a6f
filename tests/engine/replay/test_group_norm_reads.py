"""A norm that reads its weight and bias by ``F.group_norm`` in its own forward, then an
activation (transformers' BiT: ``BitGroupNormActivation``, an ``nn.GroupNorm`` subclass): the
tap serves the read, its affine written out, and later batches replay it, intercepted; exact
against the float64 loop on batches of several shapes, one of one example, through one Engine,
with no parameter on the fallback. The written-out function gives the fused one's values,
dtype and layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_fallback, assert_rel_close, reference_norms
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.engine.recipes import group_norm_math
from gradscope.losses import resolve_loss

C, CLASSES = 8, 3


class GroupNormActivation(nn.GroupNorm):
    """BiT's: the functional group norm of its own weight and bias, then an activation."""

    def __init__(self, channels: int, affine: bool = True):
        super().__init__(4, channels, eps=1e-5, affine=affine)
        self.activation = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return self.activation(x)


class Net(nn.Module):
    """Convolutions with BiT's norms between them, 1-D and 2-D, one of them without affine."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, C, 3, padding=1), GroupNormActivation(C)
        self.conv, self.norm2 = nn.Conv2d(C, C, 3, stride=2), GroupNormActivation(C)
        self.plain = GroupNormActivation(C, affine=False)
        self.line, self.norm1d = nn.Conv1d(C, C, 1), GroupNormActivation(C)
        self.head = nn.Linear(C, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, H, W)
        h = self.plain(self.norm2(self.conv(self.norm(self.stem(x)))))
        h = self.norm1d(self.line(h.flatten(2)))  # (B, C, L)
        return self.head(h.mean(2))


@pytest.mark.parametrize("sizes", [[(3, 6), (3, 6), (1, 6), (4, 7), (4, 7)], [(1, 5), (1, 5)]])
def test_group_norm_reads_are_exact_and_replay(sizes, intercepted):
    torch.manual_seed(0)
    model = Net().double().eval()
    batches = [
        ((torch.randn(b, 3, side, side, dtype=torch.float64),), torch.arange(b) % CLASSES)
        for b, side in sizes
    ]
    with Engine(model, resolve_loss("cross_entropy")) as engine:
        norms = [total(engine.norms(x, y).norm_sq).sqrt() for x, y in batches]
    assert_fallback(engine)
    assert engine.record.at(*batches[1]).replays >= 1  # the second batch, as the first
    assert intercepted and all(intercepted)
    for (x, y), got in zip(batches, norms, strict=True):
        assert_rel_close(got, reference_norms(model, x, y, "cross_entropy")[1], 1e-9)


@pytest.mark.parametrize("shape", [(2, 8, 5), (2, 8, 3, 4), (3, 8)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "bfloat16"])
def test_group_norm_written_out_is_the_fused_function(shape, layout):
    x = torch.randn(shape, dtype=torch.float64)
    w, b = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    if layout == "channels_last" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "bfloat16":  # float32 parameters on a bfloat16 input: the input's dtype
        x, w, b = x.bfloat16(), w.float(), b.float()
    fused, written = F.group_norm(x, 4, w, b, 1e-3), group_norm_math(x, 4, w, b, eps=1e-3)
    assert (written.dtype, written.stride()) == (fused.dtype, fused.stride())
    tol = 2e-2 if layout == "bfloat16" else 1e-12
    torch.testing.assert_close(written, fused, rtol=tol, atol=tol)
