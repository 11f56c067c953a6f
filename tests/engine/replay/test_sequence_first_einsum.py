"""Parameters read by ``einsum`` with the batch's index not first: XLNet's sequence-first
attention (``einsum("ibh,hnd->ibnd", h, q)``, the output ``einsum("ibnd,hnd->ibh", vec, o)``),
its position biases added by broadcasting (``q_head + r_w_bias``), and its relative-position
projection ``einsum("ibh,hnd->ibnd", pos, r)`` of a table no example owns, expanded to the batch
and cast (a copy), each of its B rows taken as its example's. Every parameter is served without
the fallback, exact against the float64 loop per parameter on batches of several shapes (one
example among them) through one Engine, and every batch after the first of its shape replays."""

from __future__ import annotations

import math

import torch
from oracle import assert_fallback, assert_rel_close, findings_by_shape
from torch import Tensor, nn

from gradscope.engine import Engine, naive_grads
from gradscope.losses import resolve_loss

VOCAB, D, HEADS, HEAD = 12, 8, 2, 4
LOSS = resolve_loss("cross_entropy")
SHAPES = [(3, 5), (1, 5), (2, 4), (3, 5), (1, 5), (2, 4), (4, 3)]  # (B, T), repeated


class RelativeAttention(nn.Module):
    """XLNet's ``XLNetRelativeAttention`` reduced: raw (D, heads, head) projections read by
    einsum on (T, B, D) hidden states, two position biases, no segments or masks."""

    def __init__(self):
        super().__init__()
        for name in "qkvor":
            setattr(self, name, nn.Parameter(torch.randn(D, HEADS, HEAD) / math.sqrt(D)))
        self.r_w_bias = nn.Parameter(torch.randn(HEADS, HEAD))
        self.r_r_bias = nn.Parameter(torch.randn(HEADS, HEAD))

    def forward(self, h: Tensor, pos: Tensor) -> Tensor:  # h, pos: (T, B, D)
        q = torch.einsum("ibh,hnd->ibnd", h, self.q)
        k = torch.einsum("ibh,hnd->ibnd", h, self.k)
        v = torch.einsum("ibh,hnd->ibnd", h, self.v)
        k_r = torch.einsum("ibh,hnd->ibnd", pos.type(self.r.dtype), self.r)
        ac = torch.einsum("ibnd,jbnd->bnij", q + self.r_w_bias, k)
        bd = torch.einsum("ibnd,jbnd->bnij", q + self.r_r_bias, k_r)
        prob = ((ac + bd) / math.sqrt(HEAD)).softmax(-1)  # (B, heads, T, T)
        vec = torch.einsum("bnij,jbnd->ibnd", prob, v)
        return h + torch.einsum("ibnd,hnd->ibh", vec, self.o)


class SequenceFirst(nn.Module):
    """Tokens laid out (T, B, D), a sinusoid position table (float32, as XLNet makes it)
    expanded to the batch, two attention layers, a head on (B, T, D)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.layers = nn.ModuleList(RelativeAttention() for _ in range(2))

    def forward(self, ids: Tensor) -> Tensor:
        b, t = ids.shape
        h = self.tokens(ids).transpose(0, 1)  # (T, B, D)
        freq = 1 / 10000 ** (torch.arange(0, D, 2.0) / D)
        angles = torch.arange(t, 0, -1.0)[:, None] * freq  # (T, D / 2)
        pos = torch.cat([angles.sin(), angles.cos()], -1)[:, None, :].expand(-1, b, -1)
        for layer in self.layers:
            h = layer(h, pos)
        return self.head(h.transpose(0, 1))


def _batch(seed: int, n: int, t: int) -> tuple[tuple[Tensor, ...], Tensor]:
    ids = torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))
    return (ids,), ids


def test_sequence_first_einsum_reads_exact_without_fallback():
    torch.manual_seed(0)
    model = SequenceFirst().double().eval()
    names = [name for name, _ in model.named_parameters()]
    with Engine(model, LOSS) as engine:
        for seed, (n, t) in enumerate(SHAPES):
            inputs, targets = _batch(seed, n, t)
            _, grads = naive_grads(model, inputs, targets, LOSS, names)
            got = engine.norms(inputs, targets).norm_sq
            for name in names:
                expected = grads[name].flatten(1).pow(2).sum(1)
                assert_rel_close(got[name], expected, 1e-9)
        assert_fallback(engine)
    findings_by_shape(engine, _batch, SHAPES)
