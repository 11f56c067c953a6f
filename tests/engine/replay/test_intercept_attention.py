"""``nn.MultiheadAttention`` replayed, its parameters' reads intercepted (``replay/intercept.py``):
packed self-attention, batch first or sequence first, with a padding mask, with the attention
weights returned or not, called twice, and with separate key and value widths (three weights,
not packed); each later batch replays intercepting, and its norms and inner products are the
float64 loop's."""

from __future__ import annotations

import pytest
import torch
from oracle import (
    assert_fallback,
    assert_influence_through_one_engine,
    assert_norms_through_one_engine,
)
from torch import Tensor, nn

D, CLASSES, T = 8, 3, 5


class Attending(nn.Module):
    """Tokens embedded, one attention called ``calls`` times (self-attention, or with keys
    and values from a second stream of other widths: ``kdim``, ``vdim``), a head on the mean."""

    def __init__(self, first: bool, weights: bool, masked: bool, calls: int, widths: bool):
        super().__init__()
        self.first, self.weights, self.masked, self.calls = first, weights, masked, calls
        self.emb = nn.Embedding(11, D)
        self.k = nn.Linear(D, 6) if widths else None
        self.v = nn.Linear(D, 7) if widths else None
        kd = {"kdim": 6, "vdim": 7} if widths else {}
        self.attn = nn.MultiheadAttention(D, 2, batch_first=first, **kd)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T)
        h = self.emb(ids)  # (B, T, D)
        mask = ids == 0 if self.masked else None  # token 0 pads
        for _ in range(self.calls):
            k = self.k(h) if self.k is not None else h
            v = self.v(h) if self.v is not None else h
            q, k, v = (h, k, v) if self.first else (t.transpose(0, 1) for t in (h, k, v))
            out, _ = self.attn(q, k, v, key_padding_mask=mask, need_weights=self.weights)
            h = h + (out if self.first else out.transpose(0, 1))
        return self.head(h.mean(1))


def _batches(b: int, n: int = 3) -> list:
    out = []
    for k in range(n):
        ids = torch.randint(1, 11, (b, T))
        ids[k % b, T - 1 - k % 2 :] = 0  # padded at the end, one example a batch
        out.append(((ids,), torch.arange(b) % CLASSES))
    return out


CASES = {
    "packed": dict(first=True, weights=False, masked=False, calls=1, widths=False),
    "padded": dict(first=True, weights=False, masked=True, calls=1, widths=False),
    "weights": dict(first=True, weights=True, masked=True, calls=1, widths=False),
    "sequence-first": dict(first=False, weights=False, masked=True, calls=1, widths=False),
    "sequence-first-weights": dict(first=False, weights=True, masked=False, calls=1, widths=False),
    "twice": dict(first=True, weights=False, masked=True, calls=2, widths=False),
    "widths": dict(first=True, weights=False, masked=True, calls=1, widths=True),
    "widths-sequence-first": dict(first=False, weights=True, masked=False, calls=2, widths=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("b", [4, 1])
def test_replayed_attention_equals_the_loop(case, b, intercepted):
    torch.manual_seed(0)
    model = Attending(**CASES[case]).double()
    batches = _batches(b)
    engine = assert_norms_through_one_engine(model, batches, "cross_entropy")
    assert engine.record.at(*batches[0]).replays == len(batches) - 1
    assert intercepted and all(intercepted)  # each later batch's attention intercepted
    assert all(type(p) is nn.Parameter for p in model.parameters())  # given back


@pytest.mark.parametrize("case", ["padded", "weights", "twice", "widths-sequence-first"])
def test_replayed_attention_inner_products_equal_the_loop(case, intercepted):
    torch.manual_seed(1)
    model = Attending(**CASES[case]).double()
    engine = assert_influence_through_one_engine(model, _batches(3), "cross_entropy")
    assert_fallback(engine)
    assert intercepted and all(intercepted)
