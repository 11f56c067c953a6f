"""The trace's fast path for owners that are the batch along one dimension (``lanes.py``): the
layouts nn.MultiheadAttention moves rows through (sequence-first, heads folded into the batch,
tokens flattened position-major) against the Jacobian, each with a twin where the examples do
mix and the fast path must give way; and models on those layouts against the float64 loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_fallback, assert_rel_close, reference_norms
from test_trace_ops import jacobian_owners, traced_owners
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine
from gradscope.engine.analysis.lanes import reshape_lane
from gradscope.engine.analysis.owners import MIXED, rows_of
from gradscope.engine.analysis.trace import RowTrace
from gradscope.engine.rows import regroup
from gradscope.losses import resolve_loss

T, D, H = 4, 6, 2
G = torch.Generator().manual_seed(0)
W3, B3 = torch.randn(3 * D, D, generator=G).double(), torch.randn(3 * D, generator=G).double()
WO = torch.randn(D, D, generator=G).double()


def _attention(x: Tensor) -> Tensor:
    """F.multi_head_attention_forward's moves, written out: (B, T, D) in and out."""
    b = x.shape[0]
    q = x.transpose(1, 0)  # (T, B, D)
    proj = F.linear(q, W3, B3).unflatten(-1, (3, D)).unsqueeze(0).transpose(0, -2)
    q, k, v = proj.squeeze(-2).contiguous()  # (T, B, D) each: unbind(0)
    q, k, v = (t.view(T, b * H, D // H).transpose(0, 1).view(b, H, T, D // H) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v).permute(2, 0, 1, 3).contiguous()  # (T, B, H, d)
    return F.linear(o.view(T * b, D), WO).view(T, b, D).transpose(1, 0)


def _heads(x: Tensor) -> Tensor:
    """Heads folded into the batch, (B*H, T, d), through bmm and a softmax over keys."""
    b = x.shape[0]
    q = x.view(b, T, H, D // H).transpose(1, 2).reshape(b * H, T, D // H)
    scores = torch.bmm(q, q.mT).softmax(-1)
    return torch.bmm(scores, torch.tanh(q)).view(b, H, T, D // H)


def _views(x: Tensor) -> Tensor:
    """Moves that keep a sequence-first lane: movedim, permute, expand, select, narrow, chunk,
    stack, cat, a reduction beside it and a cast."""
    s = x.movedim(0, 1)  # (T, B, D)
    a, c = s.narrow(2, 0, 4).chunk(2, dim=2)  # (T, B, 2) each
    h = torch.cat([a, torch.stack([c, a], 0).select(0, 0)], 2).permute(2, 0, 1)  # (4, T, B)
    return h.expand(2, *h.shape).exp().mean(1).to(torch.float64)[..., None, :]  # (2, T, 1, B)


def _cross_entropy(scores: Tensor, **kwargs) -> Tensor:
    """Per-position losses of (N, C, *d) scores against class ids 1, 2, ... (from no example)."""
    ids = torch.arange(scores[:, 0].numel()).view(scores[:, 0].shape) % scores.shape[1]
    return F.cross_entropy(scores, ids, **kwargs)


# id -> (batch, fn, whether some element depends on several examples)
CASES: dict[str, tuple[int, Callable[[Tensor], Tensor], bool]] = {
    "multi-head-attention": (3, _attention, False),
    "multi-head-attention-batch-1": (1, _attention, False),
    "heads-folded": (3, _heads, False),
    "views": (3, _views, False),
    "views-batch-1": (1, _views, False),
    "select-before-the-lane": (3, lambda x: x.transpose(0, 1).select(0, 1).tanh(), False),
    "tokens-position-major": (3, lambda x: x.transpose(0, 1).reshape(-1, D).tanh(), False),
    # a reshape that keeps the period of a lane: (T, B, D) -> (B, T*D) with B | T
    "position-major-in-rows": (2, lambda x: x.transpose(0, 1).reshape(2, -1).sin(), False),
    # the twins: the lane's dimension reduced, mixed or reshaped across examples
    "position-major-in-rows-summed": (
        3,
        lambda x: x.transpose(0, 1).reshape(3, -1).sum(1),
        True,
    ),
    "sum-over-the-lane": (3, lambda x: x.transpose(0, 1).sum(1), True),
    "softmax-over-the-lane": (3, lambda x: x.transpose(0, 1).softmax(1), True),
    "layer-norm-over-the-lane": (3, lambda x: F.layer_norm(x.transpose(0, 1), (3, D)), True),
    "matmul-contracting-the-lane": (3, lambda x: x.transpose(0, 1).mT @ x.transpose(0, 1), True),
    "matmul-over-the-lane": (3, lambda x: x.transpose(0, 1).mT @ torch.ones(3, 3).double(), True),
    "attention-across-examples": (
        3,
        lambda x: F.scaled_dot_product_attention(*(x.transpose(0, 1)[None],) * 3),
        True,
    ),
    "linear-by-a-weight-from-the-batch": (3, lambda x: F.linear(x.transpose(0, 1), x[0]), True),
    "heads-unfolded-wrongly": (3, lambda x: _heads(x).reshape(H, 3, T, -1).sum(1), True),
    "slice-of-the-lane": (3, lambda x: x.transpose(0, 1)[:, 1:].tanh(), False),
    # (B, D, T) scores over D classes, then (T, D, B): the batch after the classes
    "cross-entropy": (3, lambda x: _cross_entropy(x.mT, reduction="none"), False),
    "cross-entropy-sequence-first": (
        3,
        lambda x: _cross_entropy(x.permute(1, 2, 0), reduction="none"),
        False,
    ),
    "cross-entropy-over-the-lane": (
        3,
        lambda x: _cross_entropy(x.transpose(0, 1), reduction="none"),
        True,
    ),
    "cross-entropy-summed": (3, lambda x: _cross_entropy(x.mT, reduction="sum"), True),
    "mse-loss-sequence-first": (
        3,
        lambda x: F.mse_loss(x.transpose(0, 1), torch.ones(T, 3, D).double(), reduction="none"),
        False,
    ),
    "bce-with-logits": (
        3,
        lambda x: F.binary_cross_entropy_with_logits(
            x, x.detach().sigmoid(), pos_weight=torch.full((D,), 2.0).double(), reduction="none"
        ),
        False,
    ),
    "mse-loss-mean": (3, lambda x: F.mse_loss(x, torch.ones(3, T, D).double()), True),
    # rows 1..9 of (T*B, D): as many as a lane's, but shifted by one
    "slice-of-position-major-rows": (
        3,
        lambda x: x.transpose(0, 1).reshape(-1, D)[1:10].tanh(),
        False,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_owners_are_the_jacobians(case: str):
    batch, fn, mixes = CASES[case]
    x = torch.randn(batch, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = jacobian_owners(fn, x)
    assert bool((expected == MIXED).any()) == mixes  # the case is what its id says
    got = traced_owners(fn, x)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


@pytest.mark.parametrize(
    "case",
    [
        *("multi-head-attention", "heads-folded", "views", "cross-entropy-sequence-first"),
        *("mse-loss-sequence-first", "bce-with-logits"),
    ],
)
def test_the_layouts_take_the_fast_path(case: str):
    """No op of these reaches the owner algebra: each result's owners are a lane's tensor."""
    batch, fn, _ = CASES[case]
    x = torch.randn(batch, T, D, dtype=torch.float64)
    trace = RowTrace(batch, (x,))
    slow = []
    trace._follow = lambda name, *_: slow.append(name)
    with trace:
        out = fn(x)
    assert not slow and trace.lane(trace.owner(out)) is not None


def test_a_reshape_finds_the_lanes_period():
    assert reshape_lane((T, 3, D), (T * 3, D), (1, 1), 3) == (0, 1)  # (T*B, D): b = i % B
    assert reshape_lane((T, 6, D), (T, 3, 2, D), (1, 2), 3) == (1, 1)  # (B*H) split again
    assert reshape_lane((T, 3, D), (3, T * D), (1, 1), 3) is None  # rows straddle examples
    assert reshape_lane((6, 3, D), (3, 6 * D), (1, 1), 3) == (1, D)  # T a multiple of B


class SequenceFirstAttention(nn.Module):
    """nn.MultiheadAttention on (T, B, E), a padding mask by example, a head on its mean."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, D)
        self.attn = nn.MultiheadAttention(D, H)
        self.head = nn.Linear(D, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids.t())  # (T, B, D)
        h = self.attn(h, h, h, key_padding_mask=ids == 0, need_weights=False)[0]
        return self.head(h.mean(0))


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Embedding(20, D), layer, nn.Flatten(), nn.Linear(T * D, 3))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model", [SequenceFirstAttention, _encoder], ids=["seq-first", "encoder"])
def test_attention_layouts_are_exact_without_the_fallback(model, batch: int):
    torch.manual_seed(0)
    net = model().double().eval()
    for seed in range(2):
        ids = torch.randint(1, 20, (batch, T), generator=torch.Generator().manual_seed(seed))
        ids[0, -1] = 0  # one padded position
        y = torch.randint(0, 3, (batch,))
        got = gradscope.per_example_norms(net, ids, y)
        assert_rel_close(got, reference_norms(net, (ids,), y, "cross_entropy")[1], 1e-9)
    engine = Engine(net, resolve_loss("cross_entropy"))  # what the calls above decided
    assert_fallback(engine)


@pytest.mark.parametrize(("batch", "n", "m"), [(3, 4, 1), (3, 2, 2), (1, 3, 1), (2, 1, 3)])
def test_regroup_of_a_lane_is_the_gather(batch: int, n: int, m: int):
    """Rows (T*B*H, features) of owner (i // H) % B are moved, not gathered: the same (B, L,
    features), each example's rows in their order."""
    x = torch.randn(2, n * batch * m, 4)  # (S, rows, features)
    owner = (torch.arange(n * batch * m) // m % batch).view(1, -1).expand(2, -1)
    moved = regroup(rows_of(owner, batch), batch, x)[0][0]
    gathered = regroup(rows_of(owner.contiguous(), batch), batch, x)[0][
        0
    ]  # not an expanded view: the gather
    assert torch.equal(moved, gathered)
    shifted = regroup(rows_of(owner.roll(1, 1), batch), batch, x)[0][0]  # not a lane: the gather
    assert torch.equal(
        shifted, regroup(rows_of(owner.roll(1, 1).contiguous(), batch), batch, x)[0][0]
    )


def _random_moves(x: Tensor, rng: torch.Generator) -> Tensor:
    """Six random moves of rows: transposes, merges and splits of neighbouring dimensions,
    unsqueeze, indexing, select, unbind, narrowing, sums and elementwise ops, on whatever
    dimensions."""
    for _ in range(6):
        n, k = x.dim(), int(torch.randint(0, 10, (), generator=rng))
        d = int(torch.randint(0, n, (), generator=rng))
        e = int(torch.randint(0, n, (), generator=rng))
        if k == 0:
            x = x.transpose(d, e)
        elif k == 1 and d + 1 < n:
            x = x.reshape(*x.shape[:d], -1, *x.shape[d + 2 :])  # merge d and d + 1
        elif k == 2 and x.shape[d] % 2 == 0:
            x = x.unflatten(d, (2, -1))  # split d
        elif k == 3 and n < 5:
            x = x.unsqueeze(d)
        elif k == 4 and n > 1:
            x = x[(slice(None),) * d + (0,)]
        elif k == 5 and x.shape[d] > 1:
            x = x.narrow(d, 0, x.shape[d] - 1)
        elif k == 6 and n > 1:
            x = x.sum(d)
        elif k == 7 and n > 1:
            x = x.select(d, 0)
        elif k == 8 and n > 1:
            x = x.unbind(d)[-1]
        else:
            x = torch.tanh(x) * 2
    return x


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_random_moves_give_the_owner_algebras_answer(seed: int, batch: int):
    """The lanes and the owner algebra (every op through ``_follow``) agree on random chains."""
    x = torch.randn(batch, 4, 6, dtype=torch.float64)
    owners = []
    for fast in (True, False):
        trace = RowTrace(batch, (x,))
        if not fast:
            trace._by_lanes = lambda *_: False
        with trace:
            out = _random_moves(x, torch.Generator().manual_seed(seed))
        owners.append(trace.owner(out).expand(out.shape))
    assert torch.equal(owners[0], owners[1]), f"\n{owners[0]}\n!=\n{owners[1]}"
