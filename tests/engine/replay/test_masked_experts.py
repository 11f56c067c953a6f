"""Experts that pick their rows by a boolean mask and read a per-expert scale by each row's
expert id, as Ergo's do (transformers 5.25): each route its own row (``repeat_interleave``), a
loop over the experts routed to (``unique``), ``x[mask]`` into ``x @ W[e]`` of a fused 3-D
weight, ``out[mask] = y`` back, an RMS norm whose scale is ``weight[expert_ids]``, and the routes
summed by their gates. Replayed as an open routed region (``engine/replay/masked.py``,
``engine/replay/byid.py``) on every batch after a shape's first, exact against the float64
per-example loop: uneven experts, one expert no row is ever routed to, a batch of one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from oracle import (
    assert_fallback,
    assert_influence_through_one_engine,
    assert_norms_through_one_engine,
    findings_by_shape,
)
from torch import Tensor, nn

from gradscope.engine.steps import RegionCall

H, E, K, F_IN, CLASSES = 6, 4, 2, 5, 3


class ExpertNorm(nn.Module):
    """Ergo's: an RMS norm of each route's row, scaled by its own expert's row of ``weight``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(E, H))

    def forward(self, h: Tensor, ids: Tensor) -> Tensor:
        return F.rms_norm(h, (h.shape[-1],), eps=1e-6) * self.weight[ids]


class Experts(nn.Module):
    """Ergo's experts: each route a row, the rows of each routed expert picked by a mask."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, H, 2 * H) / H**0.5)
        self.down = nn.Parameter(torch.randn(E, 2 * H, H) / H**0.5)
        self.norm = ExpertNorm()

    def forward(self, x: Tensor, index: Tensor, gates: Tensor) -> Tensor:
        rows = x.repeat_interleave(index.shape[1], dim=0)  # (N K, H)
        flat = index.reshape(-1, 1).squeeze(-1)  # (N K,)
        out = torch.zeros_like(rows)
        for e in flat.unique():
            if e < E:
                mask = flat == e
                out[mask] = torch.relu(rows[mask] @ self.up[e]).square() @ self.down[e]
        out = self.norm(out, flat.clamp_max(E - 1)).view(*index.shape, H)  # (N, K, H)
        return (out * gates.unsqueeze(-1)).sum(1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate, self.experts = nn.Linear(F_IN, H), nn.Linear(H, E), Experts()
        self.head = nn.Linear(H, CLASSES)
        with torch.no_grad():
            self.gate.bias[-1] = -1e3  # the last expert: never among a token's top K

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)  # (B, T, H)
        flat = h.reshape(-1, H)
        top, index = self.gate(flat).sigmoid().topk(K, dim=-1)
        gates = top / top.sum(-1, keepdim=True)
        out = h + self.experts(flat, index, gates).view(h.shape)
        return self.head(out.mean(1))


def _batch(seed: int, b: int, t: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, F_IN, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (b,), generator=g)


def test_masked_experts_replay_exact_on_every_later_batch():
    torch.manual_seed(0)
    model = Model().double().eval()
    shapes = [(3, 5), (3, 5), (1, 4), (3, 5), (1, 4), (2, 6), (2, 6)]
    batches = [_batch(seed, *shape) for seed, shape in enumerate(shapes)]
    with torch.no_grad():  # the routing the batches make: uneven, the last expert never
        counts = [
            torch.bincount(
                model.gate(model.inp(x).reshape(-1, H)).topk(K).indices.flatten(), None, E
            )
            for (x,), _ in batches
        ]
    assert all(c[-1] == 0 for c in counts) and any(len(set(c[:-1].tolist())) > 1 for c in counts)
    engine = assert_norms_through_one_engine(model, batches, "cross_entropy")
    assert_fallback(engine)
    for findings in findings_by_shape(engine, _batch, shapes).values():
        (program,) = findings.programs
        calls = [s for s in program.steps if isinstance(s, RegionCall)]
        assert calls and all(c.routed and c.open for c in calls)  # none traced again


def test_masked_experts_influence_exact():
    torch.manual_seed(1)
    model = Model().double().eval()
    shapes = [(3, 5), (3, 5), (1, 4), (1, 4)]
    batches = [_batch(seed, *shape) for seed, shape in enumerate(shapes)]
    engine = assert_influence_through_one_engine(model, batches, "cross_entropy")
    findings_by_shape(engine, _batch, shapes)
