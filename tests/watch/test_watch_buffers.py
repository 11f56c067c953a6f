"""A model whose forward changes its buffers (spectral norm's power iteration, run by every
read of the weight in training mode; a counter) under the watch, whose analysed steps run the
forward twice and whose rules read the weights outside it: each step changes them once, as the
loop's does, and the run trains as without the watch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradscope.errors import ModelError
from gradscope.training.watch import Watch


class _Counted(nn.Module):
    """A counter of the forwards (with ``only``, of those of batches of that size)."""

    def __init__(self, only: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        self.only = only
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if self.only in (None, x.shape[0]):
            self.calls += 1
        return self.net(x)


def _normed() -> nn.Module:
    torch.manual_seed(0)
    norm = nn.utils.parametrizations.spectral_norm
    return nn.Sequential(norm(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(model: nn.Module, watch: Watch | None) -> nn.Module:
    """Four steps of SGD: batches of 4, 4, 4 and 3 rows (analysed, replayed, replayed, a new
    shape analysed)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(15, 5, generator=g, dtype=torch.float64), torch.arange(15) % 3
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 15)):
        opt.zero_grad()
        if watch is None:
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        else:
            watch.step((x[rows],), y[rows], torch.arange(15)[rows]).backward()
        opt.step()
    return model


@pytest.mark.parametrize("make", [_normed, _Counted], ids=["spectral_norm", "counter"])
def test_a_model_that_changes_its_buffers_trains_as_without_the_watch(tmp_path, make):
    """Before, the spectral norm's vectors moved once more on every analysed step and every
    step's read of the weight: 1e-3 apart after four steps, the weights 1e-4 by the third;
    the counter counted 6 forwards of 4 steps."""
    plain = _train(make(), None)
    with Watch(watched := make(), tmp_path / "w.parquet", "cross_entropy") as watch:
        _train(watched, watch)
    want = plain.state_dict()
    for name, value in watched.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_a_buffer_first_changed_on_a_later_analysed_step_is_refused(tmp_path):
    """A buffer the first step did not change is not kept: changed on a step whose forward
    runs twice (a batch of a new shape), it cannot be put back."""
    model = _Counted(only=3)
    with (
        pytest.raises(ModelError, match="changed its buffer calls for the first time"),
        Watch(model, tmp_path / "w.parquet", "cross_entropy") as watch,
    ):
        _train(model, watch)
