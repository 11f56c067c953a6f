"""A tensor made from a parameter in one call and read in others (Mistral Large 4's rotary table,
scaled by a learned ``alpha``, read by every layer's queries): no call but the model's holds its
reads, so a region chosen there would trace a whole forward of routed experts on every batch.
Its reads are served at the root instead (``analysis/finder.py``), the experts by a routed
region; its reads under ``no_grad`` (an indexer's) are none, in the analysis and the replay
alike; the reads of one table merge before one VJP forms ``alpha``'s gradient
(``pulled.Pulled``), the cos's and the sin's as one, by each way (``vjps.py``). Each batch's
norms are the float64 loop's."""

from __future__ import annotations

import pytest
import torch
from moe_models import Block, H, LoopExperts
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads, vjps
from gradscope.engine.steps import RegionCall
from gradscope.losses import resolve_loss

B, T, CLASSES = 3, 5, 3
LOSS = resolve_loss("cross_entropy")


class Rotary(nn.Module):
    """cos and sin of positions times frequencies scaled by ``exp(alpha)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10 ** (torch.arange(0, H, 2) / H))
        self.alpha = nn.Parameter(torch.randn(H // 2) / 4)

    def forward(self, t: int) -> tuple[Tensor, Tensor]:
        freqs = torch.arange(t, dtype=self.inv_freq.dtype)[:, None] * (
            self.inv_freq * self.alpha.exp()
        )  # (T, H/2)
        emb = torch.cat((freqs, freqs), -1)  # (T, H)
        return emb.cos(), emb.sin()


class Layer(nn.Module):
    """Queries rotated by the table, an indexer's gate read from it under ``no_grad``, then
    routed experts."""

    def __init__(self):
        super().__init__()
        self.q, self.block = nn.Linear(H, H), Block(LoopExperts())

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # (B, T, H)
        q = self.q(h)
        half = torch.cat((-q[..., H // 2 :], q[..., : H // 2]), -1)
        h = h + q * cos + half * sin
        with torch.no_grad():
            gate = torch.sigmoid((h * cos).sum(-1, keepdim=True))  # (B, T, 1)
        return self.block(h * gate)


class Backbone(nn.Module):
    """The table made once, read by each layer: only this call (or the model's) holds both."""

    def __init__(self):
        super().__init__()
        self.inp, self.rotary = nn.Linear(H, H), Rotary()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        cos, sin = self.rotary(x.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = Backbone(), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x).mean(1))


def _batch(seed: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (B,), generator=g)


@pytest.mark.parametrize("way", vjps.WAYS, ids=lambda w: w.__name__)
def test_a_table_read_across_calls_is_served_at_the_root(way, monkeypatch):
    monkeypatch.setattr(vjps, "WAYS", (way,))  # the joint VJP exact by each way
    monkeypatch.setattr(vjps, "_FASTER", {})
    backs = []
    back = vjps.back
    monkeypatch.setattr(
        vjps, "back", lambda kind, *args: backs.append(kind[0]) or back(kind, *args)
    )
    torch.manual_seed(0)
    model = Model().double()
    names = [n for n, _ in model.named_parameters()]
    with Engine(model, LOSS) as engine:
        for seed in range(4):
            inputs, targets = _batch(seed)
            got = engine.norms(inputs, targets).norm_sq
            _, grads = naive_grads(model, inputs, targets, LOSS, names, Forward())
            for name, g in grads.items():
                assert_rel_close(got[name], g.flatten(1).pow(2).sum(1), 1e-9)
    findings = engine.record.at(*_batch(0))
    assert findings.replays == 3, findings.why
    (program,) = findings.programs
    assert len(program.root) == 4  # each layer's q * cos and half * sin
    regions = [s for s in program.steps if isinstance(s, RegionCall)]
    assert regions and all(s.routed for s in regions)  # the experts', none traced
    # one VJP for cos and sin together per batch, not one per read of them (four a batch)
    assert backs == ["joint"] * 4
