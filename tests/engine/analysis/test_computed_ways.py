"""The two ways a computed tensor's per-example gradients go back to its sources
(``engine/vjps.py``): each exact against the float64 loop through one Engine over several
batches, and the faster timed once per kind of tensor, then taken on every batch."""

from __future__ import annotations

import pytest
import torch
from computed_models import T, Tables, WeightNormed
from oracle import assert_rel_close, reference_norms
from torch import nn

from gradscope.engine import Engine, total, vjps
from gradscope.losses import resolve_loss


def _grouped_weight_norm() -> nn.Module:
    """A weight-norm convolution (grouped, strided, dilated, padded): its weight computed from
    ``g`` and ``v`` on every pass."""
    conv = nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2)
    conv = nn.utils.parametrizations.weight_norm(conv, dim=2)
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(30, 2))


MODELS = {
    "grouped-weight-norm": (_grouped_weight_norm, (4, 9), 2),
    "weight-norm": (WeightNormed, (T, 3), None),
    "tables": (Tables, (T, 3), None),
}


def _norms_over_batches(
    build, shape: tuple[int, ...], classes: int | None, after=lambda k: None
) -> list[int]:
    """Four batches of 3 through one Engine, each example's norm the float64 loop's; the kinds
    timed after each batch (``after(k)`` called after batch k)."""
    torch.manual_seed(0)
    model = build().double()
    loss = "mse" if classes is None else "cross_entropy"
    kinds = []
    with Engine(model, resolve_loss(loss)) as engine:
        for _ in range(4):
            x = torch.randn(3, *shape, dtype=torch.float64)
            out = model(x)
            y = torch.randn_like(out) if classes is None else torch.randint(0, classes, (3,))
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            _, expected = reference_norms(model, (x,), y, loss)
            assert_rel_close(got, expected, 1e-9)
            kinds.append(len(vjps._FASTER))
            after(len(kinds))
        assert engine.record.at((x,), y).replays == 3
    assert not [p.name for p in engine.plan.params if p.is_fallback]
    return kinds


@pytest.mark.parametrize("way", vjps.WAYS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("name", MODELS)
def test_each_way_back_matches_loop(name: str, way, monkeypatch):
    monkeypatch.setattr(vjps, "WAYS", (way,))
    monkeypatch.setattr(vjps, "_FASTER", {})
    _norms_over_batches(*MODELS[name])
    assert set(vjps._FASTER.values()) == {way}


@pytest.mark.parametrize("name", MODELS)
def test_each_kind_timed_once(name: str, monkeypatch):
    """Each way runs on a kind's first gradients, then only the one found faster: the tensors
    every replayed pass makes anew are of the kinds the first replay made."""
    monkeypatch.setattr(vjps, "_FASTER", {})
    calls: list = []

    def counted(way):
        def run(*args):
            calls.append(run)
            return way(*args)

        return run

    monkeypatch.setattr(vjps, "WAYS", tuple(counted(way) for way in vjps.WAYS))
    kinds = _norms_over_batches(*MODELS[name], after=lambda k: k == 2 and calls.clear())
    assert kinds[1] > 0 and kinds[1:] == [kinds[1]] * 3, kinds
    assert calls and set(calls) <= set(vjps._FASTER.values()), (calls, vjps._FASTER)
