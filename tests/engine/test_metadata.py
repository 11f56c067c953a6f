"""``recipes.metadata`` kept per function: each answer the one found anew (``_metadata``, the
oracle) for every function a forward hands a mode, asked twice; a property's ``__get__``,
a new wrapper on each read, kept once."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from gradscope.engine import recipes
from gradscope.engine.recipes import _metadata, metadata


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_each_answer_the_one_found_anew() -> None:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    x = torch.randn(2, 3, 8)
    with _Seen() as seen:
        out = model(x)
        _ = out.shape, out.T, out.mT, out.dtype, out.size(0), out.dim(), len(out)
    asked = {metadata(f) for f in seen.funcs}
    assert asked == {True, False}  # both kinds met
    for _ in range(2):
        assert all(metadata(f) == _metadata(f) for f in seen.funcs)
    assert metadata(Tensor.shape.__get__) and not metadata(Tensor.T.__get__)


def test_a_propertys_getter_kept_once() -> None:
    metadata(Tensor.dtype.__get__)
    kept = len(recipes._ASKS)
    for _ in range(50):
        assert metadata(Tensor.dtype.__get__)  # a new method-wrapper each time
    assert len(recipes._ASKS) == kept
