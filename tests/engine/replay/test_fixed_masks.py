"""Rows picked by a mask the batch's shapes alone decide (Longformer's: ``zeros_like(ids)`` with
its first column set to 1, then ``bias[mask == 2] = max``, the global positions' ``nonzero``,
their count read by ``item``) are placed the same on every batch of a signature: no region, the
batches after the first of their shape replayed with the module hooks alone, exact against the
float64 loop on batches of several shapes through one Engine and through fresh public calls.
Where the batch's values are written into that mask (``written``), its rows are picked by values
again: each batch, its global positions its own, stays exact."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    assert_norms_through_one_engine,
    assert_rel_close,
    findings_by_shape,
    reference_norms,
)
from torch import Tensor, nn

import gradscope

VOCAB, D, CLASSES = 12, 4, 3
SHAPES = [(3, 5), (1, 5), (3, 5), (2, 4), (1, 5), (2, 4), (3, 5), (3, 5)]  # (B, T), repeated


class Global(nn.Module):
    """Longformer's global attention in small: the global rows projected on their own, gathered
    by the mask's positions and put back, beside a bias written where the mask is 2."""

    def __init__(self, written: bool):
        super().__init__()
        self.written, self.query = written, nn.Linear(D, D)

    def forward(self, h: Tensor, ids: Tensor) -> Tensor:  # h: (B, T, D), ids: (B, T)
        g = torch.zeros_like(ids)
        g[:, 0] = 1
        if self.written:  # the batch's values: which rows are global is each batch's own
            g[:, 1] = ids[:, 1] % 2
        mask = torch.ones(ids.shape) * (g + 1)  # 1: local, 2: global
        bias = torch.zeros(mask.shape, dtype=h.dtype)
        bias[mask == 2] = 2.0
        is_global = mask > 1
        if is_global.flatten().any().item():
            at = is_global.nonzero(as_tuple=True)
            rows = h.new_zeros(h.shape)
            rows[at] = self.query(h[at])  # (n_global, D), put back where the mask says
            h = h + rows
        return h + bias.unsqueeze(-1)


class Model(nn.Module):
    def __init__(self, written: bool):
        super().__init__()
        self.tokens, self.glob = nn.Embedding(VOCAB, D), Global(written)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.glob(self.tokens(ids), ids)).mean(1))


def _batch(seed: int, n: int, t: int) -> tuple[tuple[Tensor, ...], Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, t), generator=g),), torch.randint(0, CLASSES, (n,))


@pytest.mark.parametrize("written", [False, True], ids=["fixed", "written"])
def test_rows_picked_by_a_fixed_mask_replay_exact(written: bool):
    torch.manual_seed(0)
    model = Model(written).double().eval()
    batches = [_batch(seed, n, t) for seed, (n, t) in enumerate(SHAPES)]
    engine = assert_norms_through_one_engine(model, batches, "cross_entropy")
    for findings in findings_by_shape(engine, _batch, SHAPES, replayed=not written).values():
        if not written:  # placed by shapes: replayed with no region
            assert all(not p.regions for p in findings.programs)
        else:  # picked by values: the module's call traced on every batch
            assert all(p.regions for p in findings.programs)


def test_rows_picked_by_a_fixed_mask_through_fresh_calls():
    torch.manual_seed(0)
    model = Model(written=False).double().eval()
    for seed, (n, t) in enumerate(SHAPES[:4]):
        inputs, targets = _batch(seed, n, t)
        got = gradscope.per_example_norms(model, inputs, targets, "cross_entropy")
        assert_rel_close(got, reference_norms(model, inputs, targets, "cross_entropy")[1], 1e-9)
