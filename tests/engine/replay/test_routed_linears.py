"""Hooked ``nn.Linear`` calls inside a routed region (``engine/replay/hooked.py``): JetMoE's
layers, whose router is a Linear called inside the module whose experts' rows the batch's
values pick, and whose attention's queries are routed experts around ``scaled_dot_product_
attention`` on keys repeated along the heads. Replayed as routed regions, not traced again on
every batch, exact against the float64 per-example loop on batches of other values and other
shapes through one Engine, a batch of one among them; and a Linear on the rows the routing
picked, inside grouped experts that read nothing on the host (a closed routed region), where it
is among the calls whose outputs the backward requests: served as a read on a replayed batch, a
call on the analysed one, so the outputs requested are read off each batch's graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_models import Block, Experts
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, Want, naive_grads, total
from gradscope.engine.steps import RegionCall
from gradscope.losses import resolve_loss

H, E, K, CLASSES = 8, 4, 2, 3
LOSS = resolve_loss("cross_entropy")


class ParallelExperts(nn.Module):
    """JetMoE's: rows already sorted by expert, ``sizes`` rows each, ``F.linear(x, W[e])``."""

    def __init__(self, inp: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, out, inp) / inp**0.5)

    def forward(self, x: Tensor, sizes: list[int]) -> Tensor:
        pieces = x.split(sizes, dim=0)
        return torch.cat([F.linear(pieces[e], self.weight[e]) for e in range(E)], dim=0)


class Routing(nn.Module):
    """Top-k routing: an ``nn.Linear`` gate, the rows sorted by expert, the sizes on the host."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E)  # hooked, called inside the routed module

    def route(self, x: Tensor) -> tuple:
        top, index = self.router(x).topk(K, dim=1)  # (N, K)
        sizes = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(1, index, 1).long().sum(0)
        _, order = index.flatten().sort(0)
        gates = torch.softmax(top, dim=1).flatten()[order]
        return order, order.div(K, rounding_mode="trunc"), gates, sizes.tolist()


class MoE(Routing):
    """JetMoE's MLP: gathered, two expert products, gated, put back, plus a bias."""

    def __init__(self):
        super().__init__()
        self.up, self.down = ParallelExperts(H, 2 * H), ParallelExperts(H, H)
        self.bias = nn.Parameter(torch.randn(H) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        flat = x.reshape(-1, H)
        _, rows, gates, sizes = self.route(flat)
        gate, up = self.up(flat[rows], sizes).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up, sizes) * gates[:, None]
        out = torch.zeros_like(flat).index_add(0, rows, out)
        return out.view(b, t, H) + self.bias


class Attention(Routing):
    """JetMoE's attention: routed query experts, keys and values by a Linear, repeated k times
    along the heads, ``scaled_dot_product_attention``, routed output experts."""

    def __init__(self):
        super().__init__()
        self.q, self.o = ParallelExperts(H, H), ParallelExperts(H, H)
        self.kv = nn.Linear(H, 2 * H)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        flat = x.reshape(-1, H)
        order, rows, gates, sizes = self.route(flat)
        q = torch.zeros(b * t * K, H, dtype=x.dtype).index_add(0, order, self.q(flat[rows], sizes))
        q = q.view(b, t, K, H).transpose(1, 2)  # (b, K, t, H): a head per expert slot
        k, v = (
            z.view(b, t, 1, H).transpose(1, 2).repeat(1, K, 1, 1) for z in self.kv(x).chunk(2, -1)
        )
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, H)
        out = self.o(a[order], sizes) * gates[:, None]
        return torch.zeros_like(flat).index_add(0, rows, out).view(b, t, H)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.moe = nn.Linear(H, H), Attention(), MoE()
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + self.attn(h)
        return self.head((h + self.moe(h)).mean(1))


def _batch(seed: int, b: int, t: int, dtype=torch.float64) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, H, generator=g, dtype=dtype)
    return (x,), torch.randint(0, CLASSES, (b,), generator=g)


class Picked(nn.Module):
    """Grouped experts whose sorted tokens go through a Linear first, inside their call."""

    def __init__(self):
        super().__init__()
        self.inp, self.block = nn.Linear(H, H), Block(Experts(then=nn.Linear(H, H)))
        self.head = nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


class PickedFirst(nn.Module):
    """``Picked`` on the inputs themselves: the Linear inside the region is among the first
    calls, whose outputs the backward requests; with no head, the last call too."""

    def __init__(self, head: bool = True):
        super().__init__()
        self.block = Block(Experts(then=nn.Linear(H, H)))
        self.head = nn.Linear(H, CLASSES) if head else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(x).mean(1)
        return self.head(h) if self.head is not None else h[:, :CLASSES]


class PickedAlone(PickedFirst):
    def __init__(self):
        super().__init__(head=False)


class TwoExperts(nn.Module):
    """Two experts, each an ``nn.Linear``, on the rows a Linear router sorts to them, cut by
    slices at a count read on the host and put back by ``index_copy``."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, 1)
        self.experts = nn.ModuleList([nn.Linear(H, H), nn.Linear(H, H)])

    def forward(self, h: Tensor) -> Tensor:
        flat = h.reshape(-1, H)
        pick = (self.router(flat)[:, 0] > 0).long()
        order = torch.argsort(pick, stable=True)
        rows, n = flat[order], int((pick == 0).sum())
        out = torch.cat([self.experts[0](rows[:n]), self.experts[1](rows[n:])])
        return h + torch.empty_like(out).index_copy(0, order, out).view(h.shape)


class Sliced(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(H, H), TwoExperts(), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


# grouped_mm takes float32 alone: the loop then in float32 too, to its rounding
@pytest.mark.parametrize(
    "make, dtype, tol",
    [
        (Model, torch.float64, 1e-10),
        (Picked, torch.float32, 1e-4),
        (PickedFirst, torch.float32, 1e-4),
        (PickedAlone, torch.float32, 1e-4),
        (Sliced, torch.float64, 1e-10),
    ],
    ids=["jetmoe", "picked-rows", "picked-first", "picked-alone", "sliced"],
)
def test_linears_inside_routed_regions_replay_exact(make, dtype, tol):
    torch.manual_seed(0)
    model = make().to(dtype).eval()
    names = [n for n, _ in model.named_parameters()]
    torch.manual_seed(1)
    refs = {n: torch.randn(1, *p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    shapes = [(3, 5), (1, 4), (2, 6)]
    with Engine(model, LOSS) as engine:
        for b, t in shapes:
            for seed in range(3):
                x, y = _batch(seed, b, t, dtype)
                scores = engine.scores(x, y, Want(norms=True, refs=refs))
                _, grads = naive_grads(model, x, y, LOSS, names, Forward())
                want = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
                assert_rel_close(total(scores.norm_sq), want, tol)
                for name, ref in refs.items():  # the routers' and kv's Linears among them
                    inner = grads[name].flatten(1) @ ref.flatten()
                    assert_rel_close(scores.inner[name][:, 0], inner, tol)
            findings = engine.record.at(*_batch(0, b, t, dtype))
            assert findings.replays == 2, findings.why
            (program,) = findings.programs
            calls = [s for s in program.steps if isinstance(s, RegionCall)]
            assert calls and all(c.routed for c in calls)  # none traced again
            closed = make in (Picked, PickedFirst, PickedAlone)
            assert all(c.open for c in calls) != closed  # sizes read on the host
