"""``nn.EmbeddingBag`` with offsets where the batch's values decide its shapes: a batch of one,
its flat ids cut by a mask to as many as its bag holds (none among them), and batches whose bags
are all empty, replay the model's own call (a mask of the batch's values picks as ``nonzero``
does: its size read on the host); offsets summed from a batch of one's values cut bags all its
own, so the bag's call replays by its hooks alone. Each exact against the float64 loop."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tests.rules.test_bags import CASES, Bags, L, V, _check


def _lengths(b: int, lengths: list[list[int]]) -> list:
    """A batch of ``b`` examples for each row of ``lengths``, its ids of those lengths."""
    g = torch.Generator().manual_seed(b)
    return [
        ((torch.randint(0, V, (b, L), generator=g), torch.tensor(n),
          torch.rand(b, L, generator=g, dtype=torch.float64)), None)
        for n in lengths
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["sum", "mean-padding", "max", "sum-weighted"])
@pytest.mark.parametrize(
    "b, lengths",
    [(1, [[1], [0], [L], [3]]), (4, [[1, 2, 0, 4], [0, 0, 0, 0], [2, 2, 2, 2]])],
    ids=["one", "empty"],
)
def test_bags_of_one_example_or_none_replay(name: str, b: int, lengths: list) -> None:
    """A batch of one, whose flat ids the mask cuts to a length its values decide (as many
    ids as its bag holds, none among them), and batches whose bags are all empty: each
    replays the model's own call, exact."""
    torch.manual_seed(0)
    model = Bags(CASES[name](), weighted=name.endswith("weighted")).double()
    data = _lengths(b, lengths)
    engine = _check(model, data)
    assert [p.rule for p in engine.plan.params] == ["embedding_bag"]
    findings = engine.record.at(data[0][0], torch.zeros(b, 4, dtype=torch.float64))
    assert (findings.analyses, findings.replays) == (1, 2 * len(data) - 1), findings.why


class Flat(nn.Module):
    """Every id of each example, its bag cut by offsets summed from the examples' counts."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, 4, mode="sum")

    def forward(self, ids: Tensor, counts: Tensor) -> Tensor:
        ends = counts.cumsum(0)
        return self.bag(ids.reshape(-1), torch.cat([ends.new_zeros(1), ends[:-1]]))


def test_offsets_of_a_batch_of_one_replay_its_call() -> None:
    """Offsets made from a batch of one's values cut bags that are all its own: no region, the
    bag's call replayed by its hooks, exact."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [((torch.randint(0, V, (1, L), generator=g), torch.tensor([L])), None) for _ in "abc"]
    engine = _check(Flat().double(), data)
    assert [p.rule for p in engine.plan.params] == ["embedding_bag"]
    findings = engine.record.at(data[0][0], torch.zeros(1, 4, dtype=torch.float64))
    assert (findings.analyses, findings.replays) == (1, 5), findings.why
    (program,) = findings.programs
    assert not program.regions
