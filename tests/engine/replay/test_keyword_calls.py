"""Hooked modules called with their input by keyword (``bag(input=ids, offsets=o)``,
``head(input=h)``) read as the positional call is (``hooks.placed``): served by their rules, every
batch after the first replayed, each exact against the float64 loop. On main such a call had no
tensor inputs: its parameters went to the fallback after the first batch, whose program then
failed the second."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_norms_through_one_engine
from torch import Tensor, nn

V, L = 9, 5

CALLS = {
    "input": lambda bag, ids, offsets, w: bag(input=ids, offsets=offsets),
    "input-weighted": lambda bag, ids, offsets, w: bag(
        input=ids, per_sample_weights=w, offsets=offsets
    ),
    "offsets-weighted": lambda bag, ids, offsets, w: bag(
        ids, offsets=offsets, per_sample_weights=w
    ),
}


class ByKeyword(nn.Module):
    """An EmbeddingBag called as ``CALLS[call]``, then a Linear: each example's bag its first
    ``lengths[i]`` ids, picked by a mask of the batch's values (``routed``: the model's call
    a routed region), or all its ids, cut by offsets from ``arange`` (no region)."""

    def __init__(self, call: str, routed: bool):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(V, 4, mode="sum"), nn.Linear(4, 3)
        self.call, self.routed = call, routed

    def forward(self, ids: Tensor, lengths: Tensor, w: Tensor) -> Tensor:
        if self.routed:
            keep = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)  # (B, L)
            flat, weights, ends = ids[keep], w[keep], lengths.cumsum(0)
        else:
            flat, weights = ids.reshape(-1), w.reshape(-1)
            ends = torch.arange(1, ids.shape[0] + 1) * ids.shape[1]
        offsets = torch.cat([ends.new_zeros(1), ends[:-1]])
        return self.head(CALLS[self.call](self.bag, flat, offsets, weights))  # (B, 3)


def _batches(b: int, routed: bool) -> list:
    g = torch.Generator().manual_seed(b)
    out = []
    for _ in range(3):
        ids = torch.randint(0, V, (b, L), generator=g)
        lengths = torch.randint(1, L + 1, (b,), generator=g) if routed else torch.full((b,), L)
        lengths[0] = 1 if routed else L  # a bag of one (an empty one's row is no example's:
        # the region's Linear on it is analysed again, as on a positional call)
        w = torch.rand(b, L, generator=g, dtype=torch.float64)
        out.append(((ids, lengths, w), torch.randint(0, 3, (b,), generator=g)))
    return out


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("routed", [False, True], ids=["arange", "routed"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_bag_called_by_keyword_replays_every_later_batch(call: str, routed: bool, b: int):
    torch.manual_seed(0)
    model = ByKeyword(call, routed).double()
    batches = _batches(b, routed)
    engine = assert_norms_through_one_engine(model, batches, "cross_entropy")
    assert [p.rule for p in engine.plan.params] == ["embedding_bag", "linear", "linear"]
    findings = engine.record.at(*batches[0])
    assert (findings.analyses, findings.replays) == (1, 2), findings.why


class Positions(nn.Module):
    """Tokens and a position table (its ``arange`` rows shared by the batch: expanded to it,
    the call's input replaced) looked up by keyword, a Linear by keyword on their sum."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, 4), nn.Embedding(L, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.wte(input=ids) + self.wpe(input=torch.arange(ids.shape[1]))  # (B, L, 4)
        return self.head(input=h).sum(1)  # (B, 3)


@pytest.mark.parametrize("b", [1, 4])
def test_tables_and_a_linear_called_by_keyword_replay(b: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(b)
    batches = [
        ((torch.randint(0, V, (b, L), generator=g),), torch.randint(0, 3, (b,), generator=g))
        for _ in range(3)
    ]
    engine = assert_norms_through_one_engine(Positions().double(), batches, "cross_entropy")
    assert {p.rule for p in engine.plan.params} == {"embedding", "linear"}
    findings = engine.record.at(*batches[0])
    assert (findings.analyses, findings.replays) == (1, 2), findings.why
