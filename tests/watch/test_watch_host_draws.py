"""A forward that draws from numpy's or Python's global generator beside torch's (transformers'
speech models draw their SpecAugment masks from numpy's): every forward of a watched step draws
what the first drew, each row's norm is the loop's under the batch's masks, the run trains as
without the watch, and what cannot draw the batch's masks (an example alone; the run record's
replay) is refused."""

from __future__ import annotations

import random

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradscope.errors import ModelError
from gradscope.training.watch import Watch


def _masks(rows: int, width: int) -> torch.Tensor:
    """A mask a row, drawn from numpy's generator, scaled by one draw of Python's."""
    return torch.from_numpy(np.random.rand(rows, width) > 0.3) * (1 + random.random())


class _Masked(nn.Module):
    """Inputs masked by host draws, then dropout (torch's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 3))
        self.double()

    def forward(self, x):
        return self.net(x * _masks(*x.shape))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(15, 5, generator=g, dtype=torch.float64), torch.arange(15) % 3


STEPS = (slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 15))  # analysed, replayed, a new shape


def _seed() -> None:
    torch.manual_seed(2)
    np.random.seed(2)
    random.seed(2)


def _host() -> tuple:
    return np.random.get_state()[1].tobytes(), np.random.get_state()[2], random.getstate()


def test_a_forward_drawing_from_the_host_trains_as_without_the_watch(tmp_path):
    """Before, a step's second forward drew other masks: refused as giving other losses."""
    x, y = _data()
    plain, watched = _Masked(), _Masked()
    runs = []
    for model in (plain, watched):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _seed()
        with Watch(model, tmp_path / f"{len(runs)}.parquet") if model is watched else _Nil() as w:
            for rows in STEPS:
                opt.zero_grad()
                if w is None:
                    F.cross_entropy(model(x[rows]), y[rows]).backward()
                else:
                    w.step(x[rows], y[rows], torch.arange(15)[rows]).backward()
                opt.step()
        runs.append((_host(), torch.get_rng_state()))
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


class _Nil:
    def __enter__(self):
        return None

    def __exit__(self, *_):
        return None


def test_each_rows_norm_is_the_loops_under_the_batchs_host_masks(tmp_path):
    x, y = _data()
    model, plain = _Masked().train(), _Masked().train()
    _seed()
    began = np.random.get_state(), random.getstate(), torch.get_rng_state()
    with Watch(model, tmp_path / "w.parquet") as w:
        w.step(x[:4], y[:4], torch.arange(4))
    np.random.set_state(began[0])
    random.setstate(began[1])
    masks = _masks(4, 5)  # the batch's, as its forward drew them first
    norms = []
    for i in range(4):
        torch.set_rng_state(began[2])  # dropout's masks: the batch's rows, this one kept
        hidden = torch.tanh(plain.net[0](x[:4] * masks))
        out = plain.net[3](plain.net[2](hidden))[i]
        grads = torch.autograd.grad(F.cross_entropy(out, y[i]), list(plain.parameters()))
        norms.append(torch.sqrt(sum(g.square().sum() for g in grads)).item())
    got = pq.read_table(tmp_path / "w.parquet").column("grad_norm").to_pylist()
    np.testing.assert_allclose(got, norms, rtol=1e-10)


class _MaskedGain(_Masked):
    """Host masks, and a gain read through ``torch.mm``, which no rule serves: the exact
    fallback runs each example alone, which cannot draw the batch's masks."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 3).double()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x):
        return torch.mm(self.net(x * _masks(*x.shape)), torch.diag(self.gain))


def test_an_example_alone_under_host_masks_is_one_line(tmp_path):
    x, y = _data()
    with (
        Watch(_MaskedGain().train(), tmp_path / "w.parquet") as watch,
        pytest.raises(ModelError, match="cannot draw the masks the batch drew"),
    ):
        watch.step(x[:4], y[:4], torch.arange(4))
