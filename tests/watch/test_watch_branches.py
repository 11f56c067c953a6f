"""The watch on a forward that branches on the batch's values (``analysis/branches.py``) with
dropout on: an example that takes the other way alone cannot draw the batch's masks, so its
way is checked with dropout left out (``analysis/undrawn.py``); each example's numbers are
those of its own loss under the batch's masks, against a loop that draws them again."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from oracle import redrawn_norms
from torch import nn

from gradscope.errors import ModelError
from gradscope.training.watch import Watch


def _data(n: int):
    torch.manual_seed(1)
    return torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))


def _own_norms(model: nn.Module, x, y, steps: int, way) -> list[float]:
    """Each example's gradient norm over ``steps`` steps seeded as the watched ones, its loss
    ``way(h, i)`` of its rows of the batch's dropped-out features ``h``, the masks drawn again
    (``oracle.redrawn_norms``)."""

    def row(i: int):
        return nn.functional.cross_entropy(way(model.drop(model.fc(x))[i], i), y[i])

    return redrawn_norms(
        model, len(y), [(row, lambda: nn.functional.cross_entropy(model(x), y))] * steps
    )


class _DroppedBranch(nn.Module):
    """Dropout, and a branch on whether every example's first feature is positive, which an
    example alone may take the other way (``analysis/branches.py``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(5, 3).double(), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return h * 2 if bool((x[:, 0] > 0).all()) else h


def test_dropout_with_a_branch_on_the_batch_is_one_line(tmp_path):
    """Examples that take the other way alone cannot draw the batch's masks: checked with
    dropout left out, where their loss alone is not their loss in the batch: refused in one
    line, not scored as the batch's way. Where each takes the batch's way, read off the tensor
    ``all()`` reduced, none runs: watched."""
    x, y = _data(4)
    x[:, 0] = torch.tensor([1.0, -1.0, 1.0, 1.0])
    with (
        Watch(_DroppedBranch().train(), tmp_path / "w.parquet") as watch,
        pytest.raises(ModelError, match="branches on a value of the whole batch") as raised,
    ):
        watch.step(x, y, torch.arange(4))
    assert "\n" not in str(raised.value)
    x[:, 0] = -1.0
    with Watch(_DroppedBranch().train(), tmp_path / "kept.parquet") as watch:
        watch.step(x, y, torch.arange(4)).backward()
    assert pq.read_table(tmp_path / "kept.parquet").num_rows == 4


class _DroppedShortcut(nn.Module):
    """Dropout, then transformers' kind of shortcut: where no example's first feature is
    negative, the masking by it is skipped; alone, an example with a positive one skips it to
    the same loss."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(5, 3).double(), nn.Dropout(0.5)

    def forward(self, x):
        h, keep = self.drop(self.fc(x)), x[:, :1] > 0
        return h if bool(keep.all()) else h * keep


def test_dropout_with_a_shortcut_each_example_takes_alone_is_watched(tmp_path):
    """Two of four examples take the shortcut alone: checked with dropout left out (their
    losses alone and in the batch agree), each norm is its loss's under the batch's masks, on
    the analysed batch and the replayed one, and the generator is left where one forward
    leaves it."""
    torch.manual_seed(0)
    watched = _DroppedShortcut().train()
    plain = copy.deepcopy(watched)
    x, y = _data(4)
    x[:, 0] = torch.tensor([1.0, -1.0, 2.0, -2.0])
    torch.manual_seed(3)
    with Watch(watched, tmp_path / "w.parquet") as watch:
        for _ in range(2):
            watch.step(x, y, torch.arange(4)).backward()
    after = torch.get_rng_state()
    norms = _own_norms(plain, x, y, 2, lambda h, i: h if x[i, 0] > 0 else h * 0)
    assert torch.equal(torch.get_rng_state(), after)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=1e-10, atol=1e-12)


class _DroppedSmall(nn.Module):
    """A branch on a sum over the batch, which no example's own value can be read off: each
    example alone is small, the batch is not; either way, the same loss."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(5, 3).double(), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return h if bool(x.abs().sum() < 10) else h * 1.0


def test_dropout_where_every_example_takes_the_other_way_alone_is_watched(tmp_path):
    """Each example run alone to the branch with dropout left out, the batch's way taken by the
    whole batch without it, the examples' own together: watched, each norm its own."""
    torch.manual_seed(0)
    watched = _DroppedSmall().train()
    plain = copy.deepcopy(watched)
    x, y = _data(4)
    x = x / x.abs().sum(1, keepdim=True) * 5  # each 5 alone, 20 in all
    torch.manual_seed(3)
    with Watch(watched, tmp_path / "w.parquet") as watch:
        watch.step(x, y, torch.arange(4)).backward()
    norms = _own_norms(plain, x, y, 1, lambda h, i: h)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=1e-10, atol=1e-12)


class _DroppedRead(nn.Module):
    """A branch on a value dropout drew: without the draw it may be another."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(5, 3).double(), nn.Dropout(0.5)

    def forward(self, x):
        h = self.drop(self.fc(x))
        return h * 2 if bool((h[:, 0] != 0).all()) else h


def test_dropout_with_a_branch_on_what_it_drew_is_one_line(tmp_path):
    torch.manual_seed(0)
    model = _DroppedRead().train()
    x, y = _data(8)
    with (
        Watch(model, tmp_path / "w.parquet") as watch,
        pytest.raises(ModelError, match="reads a value drawn from them") as raised,
    ):
        watch.step(x, y, torch.arange(8))
    assert "\n" not in str(raised.value)
