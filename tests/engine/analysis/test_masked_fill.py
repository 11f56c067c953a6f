"""A tensor filled in place where a mask the batch's data make says (``masked_fill_``): its
filled elements take the fill's owners, none, so the owners the trace gives depend on the
mask's values, and no need is recorded for them (``analysis/follow.py``). Replayed batches with
other masks (none, some tokens, one example whole, every token) in either order still give the
loop's norms: the rows it reads are the examples' by position wherever a program holds. The
mask's values only make the analysis more careful (a flattened batch filled whole sends the
Linear reading it to the fallback), never a layout another mask contradicts."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads
from gradscope.losses import resolve_loss

D, CLASSES, B, T = 6, 3, 3, 4
LOSS = resolve_loss("cross_entropy")


class Filled(nn.Module):
    """Hidden states filled where the mask says: (B, T, D) rows (``rows``), or flattened to
    (B*T, D) first (``flat``); ids filled with a pad before a lookup (``ids``); or zeros
    filled with ones and read by a raw weight (``zeros``: rows of no example on every mask); or
    a float padding mask made so, zeros filled with -inf, for ``nn.MultiheadAttention``
    (``attn``: every example keeps its first token)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(10, D) if kind == "ids" else nn.Linear(4, D)
        self.fc, self.head = nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.w = nn.Parameter(torch.randn(D, D) / 3)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:  # (B, T, 4) or (B, T) ids; (B, T)
        b, t = mask.shape
        if self.kind == "ids":
            h = self.emb(x.clone().masked_fill_(mask, 0))
        elif self.kind == "rows":
            h = self.emb(x).masked_fill_(mask[..., None], 0.5)
        elif self.kind == "attn":
            pad = x.new_zeros(b, t).masked_fill_(mask & (torch.arange(t) > 0), float("-inf"))
            h = self.emb(x)
            h = h + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        elif self.kind == "flat":
            h = self.emb(x).reshape(b * t, D).masked_fill_(mask.reshape(b * t, 1), 0.5)
        else:
            z = x.new_zeros(b * t, D).masked_fill_(mask.reshape(b * t, 1), 1.0)
            h = self.emb(x) + (z @ self.w).reshape(b, t, D)
        return self.head(torch.tanh(self.fc(h)).reshape(b, t, D)).mean(1)


class Model(nn.Module):
    """``Filled`` as a call of the model's, so that its reads make a region."""

    def __init__(self, kind: str):
        super().__init__()
        self.filled = Filled(kind)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.filled(x, mask)


def _mask(kind: str, g: torch.Generator) -> Tensor:
    """(B, T): no token, some, example 1's every token, every token."""
    if kind == "some":
        return torch.rand(B, T, generator=g) < 0.4
    mask = torch.full((B, T), kind == "all")
    if kind == "example":
        mask[1] = True
    return mask


@pytest.mark.parametrize("kind", ["rows", "flat", "ids", "zeros", "attn"])
@pytest.mark.parametrize(
    "order", [("none", "some", "example", "all"), ("all", "example", "some", "none")]
)
def test_batches_of_other_masks_equal_the_loop(kind: str, order: tuple[str, ...]):
    torch.manual_seed(0)
    model = Model(kind).double()
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(0)
    engine = Engine(model, LOSS)
    with engine:
        for masked in order:
            if kind == "ids":
                x = torch.randint(1, 10, (B, T), generator=g)
            else:
                x = torch.randn(B, T, 4, generator=g, dtype=torch.float64)
            inputs, targets = (x, _mask(masked, g)), torch.arange(B) % CLASSES
            got = engine.norms(inputs, targets).norm_sq
            _, grads = naive_grads(model, inputs, targets, LOSS, names, Forward())
            for name, grad in grads.items():
                assert_rel_close(got[name], grad.flatten(1).pow(2).sum(1), 1e-9)
    findings = engine.record.at(inputs, targets)
    careful = kind == "flat" and order[0] == "all"  # the Linear's rows all filled: the fallback
    assert findings.replays == 3 - careful, findings.why
    assert bool(engine.record.moves) == careful, engine.record.moves
