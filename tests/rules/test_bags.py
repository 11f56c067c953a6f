"""``nn.EmbeddingBag`` with offsets (bags cut from flat ids, empty ones among them) and in max
mode, through ``gradscope.per_example_norms`` and one Engine over several batches, against the
float64 per-example loop; bags that are not the examples go to the fallback, named."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss

L, V = 5, 9


class Bags(nn.Module):
    """Example i's bag is its first ``lengths[i]`` ids, cut from the flat ids by offsets
    (``per`` bags an example: its ids in that many runs, the bags' outputs side by side)."""

    def __init__(self, bag: nn.EmbeddingBag, weighted: bool = False, per: int = 1):
        super().__init__()
        self.bag, self.weighted, self.per = bag, weighted, per

    def forward(self, ids: Tensor, lengths: Tensor, w: Tensor) -> Tensor:
        keep = torch.arange(ids.shape[1]) < lengths.unsqueeze(1)  # (B, L)
        sizes = lengths.repeat_interleave(self.per) // self.per  # a bag's size: its share
        sizes[self.per - 1 :: self.per] += lengths % self.per
        ends = sizes.cumsum(0)
        offsets = torch.cat(
            [ends.new_zeros(1), ends if self.bag.include_last_offset else ends[:-1]]
        )
        weights = w[keep] if self.weighted else None
        out = self.bag(ids[keep], offsets, per_sample_weights=weights)  # (B * per, D)
        return out.reshape(ids.shape[0], -1)


def lengths_of(kind: str, b: int, g: torch.Generator) -> Tensor:
    if kind == "equal":
        return torch.full((b,), L)
    lengths = torch.randint(0, L + 1, (b,), generator=g)
    lengths[0] = 1  # a bag of one
    if b > 2:
        lengths[2] = 0  # an empty bag
    return lengths


def batches(kind: str, b: int, n: int = 3) -> list:
    g = torch.Generator().manual_seed(b)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (b, L), generator=g)
        w = torch.rand(b, L, generator=g, dtype=torch.float64)
        out.append(((ids, lengths_of(kind, b, g), w), None))
    return out


CASES = {
    "sum": lambda: nn.EmbeddingBag(V, 4, mode="sum"),
    "mean-padding": lambda: nn.EmbeddingBag(V, 4, mode="mean", padding_idx=0),
    "max": lambda: nn.EmbeddingBag(V, 4, mode="max"),
    "max-padding": lambda: nn.EmbeddingBag(V, 4, mode="max", padding_idx=1),
    "sum-last-offset": lambda: nn.EmbeddingBag(V, 4, mode="sum", include_last_offset=True),
    "sum-weighted": lambda: nn.EmbeddingBag(V, 4, mode="sum"),
}


def _check(model: nn.Module, data: list) -> Engine:
    """Each batch by a fresh call and by one Engine, against the loop: the Engine's, its plan."""
    fn = resolve_loss("mse")
    with torch.no_grad():
        data = [(x, torch.randn_like(model(*x))) for x, _ in data]
    expected = [reference_norms(model, x, y)[1] for x, y in data]
    for (x, y), norms in zip(data, expected, strict=True):
        assert_rel_close(gradscope.per_example_norms(model, x, y, "mse"), norms, 1e-9)
    with Engine(model, fn) as engine:
        for (x, y), norms in zip(data, expected, strict=True):
            assert_rel_close(total(engine.norms(x, y).norm_sq).sqrt(), norms, 1e-9)
    return engine


@pytest.mark.parametrize("kind", ["ragged", "equal"])
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_bags_by_offsets_match_the_loop(name: str, b: int, kind: str) -> None:
    torch.manual_seed(0)
    model = Bags(CASES[name](), weighted=name.endswith("weighted")).double()
    engine = _check(model, batches(kind, b))
    assert [(p.name, p.rule) for p in engine.plan.params] == [("bag.weight", "embedding_bag")]


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("padding", [None, 2])
def test_max_of_rows_matches_the_loop_and_replays(b: int, padding: int | None) -> None:
    """A (B, L) input in max mode, a row all padding among them (no member: no gradient)."""
    torch.manual_seed(0)
    model = nn.EmbeddingBag(V, 4, mode="max", padding_idx=padding).double()
    data = []
    for k, ((ids, _, _), _) in enumerate(batches("ragged", b)):
        if padding is not None and k:
            ids[-1] = padding
        data.append(((ids,), None))
    engine = _check(model, data)
    assert [p.rule for p in engine.plan.params] == ["embedding_bag"]
    # the fresh calls and the Engine share the model's record: each pass after the first
    findings = engine.record.at(data[0][0], torch.zeros(b, 4, dtype=torch.float64))
    assert findings.replays == 2 * len(data) - 1


def test_bags_of_several_examples_go_to_the_fallback_named() -> None:
    model = Bags(nn.EmbeddingBag(V, 4, mode="sum"), per=2).double()
    engine = _check(model, batches("equal", 3))
    (p,) = engine.plan.params
    assert p.is_fallback and "its 6 bags are not the batch's 3 examples" in p.note
