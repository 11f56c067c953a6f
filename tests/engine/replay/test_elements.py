"""Parameters read element by element (each element of the result one example's, or none's),
replayed: exact against the float64 loop through one Engine over several batches, and the check
that no element of several examples or of none gets a gradient read on the host only where
the analysed batch had such an element."""

from __future__ import annotations

from collections import Counter

import torch
from oracle import assert_rel_close, reference_norms
from syncs import counted
from torch import Tensor, nn

from gradscope.engine import Engine, total
from gradscope.losses import resolve_loss
from tests.engine.analysis.test_broadcast import SequenceFirst

D = 4


class Similarity(nn.Module):
    """CLIP's head: a (B, B) similarity scaled by ``logit_scale.exp()``, each example's loss
    reading its own diagonal element; the others are no one example's."""

    def __init__(self):
        super().__init__()
        self.text, self.image = nn.Linear(3, D), nn.Linear(3, D)
        self.logit_scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: Tensor) -> Tensor:  # (B, 2, 3)
        sims = self.text(x[:, 0]) @ self.image(x[:, 1]).T * self.logit_scale.exp()  # (B, B)
        return sims.diagonal()[:, None]


def _replayed(model: nn.Module, shape: tuple[int, ...]) -> tuple[Counter, Counter]:
    """Over four batches of one Engine, each exact against the loop: the host reads of a
    plain step and of the replayed fourth pass."""
    torch.manual_seed(0)
    model = model.double()
    loss = resolve_loss("mse")
    params = list(model.parameters())
    batches = [torch.randn(*shape, dtype=torch.float64) for _ in range(4)]
    engine = Engine(model, loss)
    with engine, counted() as calls:
        for x in batches:
            y = torch.randn(x.shape[0], model(x).shape[1], dtype=torch.float64)
            calls.clear()
            torch.autograd.grad(loss(model(x), y).sum(), params)
            plain = Counter(calls)
            calls.clear()
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            ours = Counter(calls)
            _, expected = reference_norms(model, (x,), y, "mse")
            assert_rel_close(got, expected, 1e-9)
        assert engine.record.at((x,), y).replays == 3
    assert not [p.name for p in engine.plan.params if p.is_fallback]
    return ours, plain


def test_elements_each_one_examples_read_nothing_on_the_host():
    ours, plain = _replayed(SequenceFirst(), (3, 3, 3))
    assert not ours - plain, (ours, plain)


def test_elements_of_no_example_are_still_checked():
    ours, plain = _replayed(Similarity(), (3, 2, 3))
    assert (ours - plain)["__bool__"] == 1, (ours, plain)
