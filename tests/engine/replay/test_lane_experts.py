"""Llama 4's experts (``engine/analysis/experts.py``: ``_lanes_recipe``): every token through
every expert by ``bmm`` on a fused (E, in, out) weight, scaled by router scores that are -inf
but at each token's top k (a scatter within each row, which picks no rows). Replayed by light
regions (``replay/reads.py``: ``_bmm``), not traced again on every batch, exact against the
float64 per-example loop on batches of other values and other shapes through one Engine, a
batch of one among them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, Want, naive_grads, total
from gradscope.engine.steps import RegionCall
from gradscope.losses import resolve_loss

H, E, K, INNER, CLASSES = 8, 4, 2, 6, 3
LOSS = resolve_loss("cross_entropy")


class Router(nn.Linear):
    """Llama 4's: a Linear of its own class (no rule's), scores -inf but at each row's top k."""

    def forward(self, x: Tensor) -> Tensor:
        logits = super().forward(x)
        top, index = torch.topk(logits, K, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
        return torch.sigmoid(scores)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * INNER) / H**0.5)
        self.down = nn.Parameter(torch.randn(E, INNER, H) / INNER**0.5)

    def forward(self, x: Tensor) -> Tensor:
        x = x.view(E, -1, H)  # (E, N, H): every token, once per expert
        gate, up = torch.bmm(x, self.gate_up).chunk(2, dim=-1)
        return torch.bmm(up * F.silu(gate), self.down).view(-1, H)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts, self.shared = Router(H, E), Experts(), nn.Linear(H, H)

    def forward(self, h: Tensor) -> Tensor:
        flat = h.reshape(-1, H)
        scores = self.router(flat)  # (N, E)
        routed = flat.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.experts(routed).view(E, -1, H).sum(0)
        return (self.shared(flat) + out).view(h.shape)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(H, H), MoE(), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.head((h + self.moe(h)).mean(1))


def _batch(seed: int, b: int, t: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, H, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (b,), generator=g)


def test_experts_every_token_runs_replay_light_and_exact():
    torch.manual_seed(0)
    model = Model().double().eval()
    names = [n for n, _ in model.named_parameters()]
    torch.manual_seed(1)
    refs = {n: torch.randn(1, *p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    with Engine(model, LOSS) as engine:
        for b, t in [(3, 5), (1, 4), (2, 6)]:
            for seed in range(3):
                x, y = _batch(seed, b, t)
                scores = engine.scores(x, y, Want(norms=True, refs=refs))
                _, grads = naive_grads(model, x, y, LOSS, names, Forward())
                want = sum(g.flatten(1).pow(2).sum(1) for g in grads.values())
                assert_rel_close(total(scores.norm_sq), want, 1e-10)
                for name, ref in refs.items():  # the experts' fused weights among them
                    inner = grads[name].flatten(1) @ ref.flatten()
                    assert_rel_close(scores.inner[name][:, 0], inner, 1e-10)
            findings = engine.record.at(*_batch(0, b, t))
            assert findings.replays == 2, findings.why
            (program,) = findings.programs
            calls = [s for s in program.steps if isinstance(s, RegionCall)]
            assert calls and all(c.light is not None and not c.routed for c in calls)
