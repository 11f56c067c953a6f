"""Rows along another dimension than 0 in a routed region (``engine/replay/moved.py``): Switch
Transformers' experts move the examples to dimension 2 (``mask.permute(2, 1, 0)``), pick each
expert's rows as ``h[None, rows]`` and reshape them back. Replayed as routed regions, never
traced again, nothing on the fallback, exact against the float64 per-example loop on batches of
other values and other shapes through one Engine, a batch of one among them; and rows moved
last and joined there, which the flow does not follow, end it: the region traced again, exact."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, Want, naive_grads, total
from gradscope.engine.steps import RegionCall
from gradscope.losses import resolve_loss

H, E, CLASSES = 8, 3, 3
LOSS = resolve_loss("cross_entropy")


class Router(nn.Module):
    """Switch's top-1 router: a one-hot (N, 1, E) of each row's expert, and its probability."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(H, E, bias=False)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        probs = torch.softmax(self.classifier(h), dim=-1)  # (N, E)
        chosen = nn.functional.one_hot(probs.argmax(-1), E)
        return chosen[:, None], probs.max(-1).values[:, None]  # (N, 1, E), (N, 1)


class Experts(nn.ModuleList):
    """Switch's experts: each the rows its mask column picks, as ``h[None, rows]``."""

    def __init__(self, mixed: bool):
        super().__init__(nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H)) for _ in range(E))  # fmt: skip
        self.mixed = mixed

    def forward(self, h: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(h)
        mask = chosen.permute(2, 1, 0)  # (E, 1, N): the examples along dimension 2
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            k, rows = torch.where(mask[e].squeeze(0))
            picked = h[None, rows]  # (1, n, H)
            if self.mixed:  # the rows moved last and joined there: a move the flow ends at
                moved = picked.permute(2, 0, 1)  # (H, 1, n)
                picked = torch.cat([moved, moved], 2)[..., : rows.shape[0]].permute(1, 2, 0)
            y = self[int(e)](picked.reshape(-1, H)) * weights[rows, k, None]
            out.index_add_(0, rows, y)
        return out


class Sparse(nn.Module):
    def __init__(self, mixed: bool):
        super().__init__()
        self.router, self.experts = Router(), Experts(mixed)

    def forward(self, h: Tensor) -> Tensor:
        chosen, weights = self.router(h)
        return self.experts(h, chosen, weights)


class Model(nn.Module):
    def __init__(self, mixed: bool = False):
        super().__init__()
        self.inp, self.moe, self.head = nn.Linear(H, H), Sparse(mixed), nn.Linear(H, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.head((h + self.moe(h.reshape(-1, H)).view(h.shape)).mean(1))


def _batch(seed: int, b: int, t: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, H, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (b,), generator=g)


def _exact(model: nn.Module, engine: Engine, x: tuple, y: Tensor, refs: dict) -> None:
    names = [n for n, _ in model.named_parameters()]
    scores = engine.scores(x, y, Want(norms=True, refs=refs))
    _, grads = naive_grads(model, x, y, LOSS, names, Forward())
    assert_rel_close(total(scores.norm_sq), sum(g.flatten(1).pow(2).sum(1) for g in grads.values()), 1e-10)  # fmt: skip
    for name, ref in refs.items():  # every expert's among them
        assert_rel_close(scores.inner[name][:, 0], grads[name].flatten(1) @ ref.flatten(), 1e-10)


@pytest.mark.parametrize("mixed", [False, True], ids=["switch", "mixed"])
def test_rows_moved_off_dimension_zero_replay_exact(mixed):
    torch.manual_seed(0)
    model = Model(mixed).double().eval()
    torch.manual_seed(1)
    refs = {n: torch.randn(1, *p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    with Engine(model, LOSS) as engine:
        for b, t in [(3, 5), (1, 4), (2, 6)]:
            for seed in range(3):
                _exact(model, engine, *_batch(seed, b, t), refs)
            findings = engine.record.at(*_batch(0, b, t))
            if not mixed:
                assert findings.replays == 2, findings.why
                (program,) = findings.programs
                calls = [s for s in program.steps if isinstance(s, RegionCall)]
                assert calls and all(c.routed for c in calls)  # none traced again
        # the flow ends at the join: the region traced from the first replay on
        assert engine.record.traced == ({Experts} if mixed else set())
        assert not [p.name for p in engine.plan.params if p.is_fallback]
