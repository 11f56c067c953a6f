"""The jvp engine's own forward-mode rules (``engine.tangents``) against autograd's, in float64:
a dual's arithmetic with a plain tensor or a number, either side, broadcast; attention with
each of its masks, grouped heads and any of its three inputs carrying a tangent; and routed
experts' grouped products, which autograd has no rule for, against their definition and the
float64 loop."""

from __future__ import annotations

import operator

import moe_models
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from oracle import reference_influence
from torch import Tensor, nn

from gradscope.engine import Engine, Influence, reference_gradients
from gradscope.engine.jvp import composite_attention
from gradscope.engine.tangents import Tangents
from gradscope.losses import resolve_loss


def _both(fn, *args: Tensor | float, tangents: tuple[bool, ...], tol: float = 1e-12) -> None:
    """``fn`` on ``args`` with a tangent where ``tangents`` says, under Tangents and under
    autograd's rules alone (attention on its math backend, which has them): the same value
    and tangent (``tol`` 0: bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    got, want = [], []
    for mode, out in ((Tangents, got), (None, want)):
        with torch.no_grad(), fwAD.dual_level(), composite_attention():
            duals = [
                fwAD.make_dual(a, torch.randn(a.shape, generator=gen, dtype=a.dtype)) if t else a
                for a, t in zip(args, tangents, strict=True)
            ]
            if mode is None:
                out.extend(fwAD.unpack_dual(fn(*duals)))
            else:
                with mode():
                    out.extend(fwAD.unpack_dual(fn(*duals)))
        gen.manual_seed(0)
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    if want[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)


OPS = [
    operator.mul,
    operator.add,
    operator.sub,
    operator.truediv,
    torch.mul,
    lambda a, b: torch.add(a, b, alpha=3),
    lambda a, b: torch.sub(a, b, alpha=0.5),
    Tensor.div,
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shapes", [((4, 3), (4, 3)), ((4, 3), (3,)), ((3,), (4, 3))], ids=str)
@pytest.mark.parametrize("side", [(True, False), (False, True), (True, True)], ids=str)
def test_arithmetic_with_a_plain_operand_is_autograds(op, shapes, side) -> None:
    """Either operand dual, the other a plain tensor (broadcast either way); both dual:
    autograd's own rule."""
    a, b = (torch.rand(s, dtype=torch.float64) + 0.5 for s in shapes)
    _both(op, a, b, tangents=side)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: 0.5 * x,
        lambda x: x * 0.5,
        lambda x: 1.0 + x,
        lambda x: x - 2.0,
        lambda x: 2.0 - x,
        lambda x: x / 3.0,
        lambda x: 3.0 / x,
    ],
)
def test_arithmetic_with_a_number_is_autograds(fn) -> None:
    _both(fn, torch.rand(4, 3, dtype=torch.float64) + 0.5, tangents=(True,))


def test_an_operands_tangent_is_not_shared_with_the_result() -> None:
    """``x + c`` gets a tangent of its own: an in-place op on it leaves x's alone."""
    with torch.no_grad(), fwAD.dual_level(), Tangents():
        x = fwAD.make_dual(torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        y = x + 1.0
        y.mul_(4.0)
        assert fwAD.unpack_dual(x).tangent.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "side", [(True, True, True), (False, True, False), (True, False, True)], ids=str
)
def test_addmm_of_a_bias_row_is_autograds(side) -> None:
    """``torch.addmm(b, x, W)``, GPT-2's Conv1D, by the linear rule."""
    b, x, w = (torch.randn(s, dtype=torch.float64) for s in ((3,), (4, 5), (5, 3)))
    _both(torch.addmm, b, x, w, tangents=side)


# (convolution, input shape, weight shape, what follows the bias)
CONVS = [
    (F.conv2d, (2, 4, 5, 5), (6, 2, 3, 3), {"stride": 2, "padding": 1, "groups": 2}),
    (F.conv2d, (4, 5, 5), (6, 4, 3, 3), {"padding": "same"}),  # an unbatched image
    (F.conv1d, (2, 3, 9), (4, 3, 2), {"dilation": 2}),
    (F.conv3d, (1, 2, 3, 4, 4), (3, 2, 2, 2, 2), {}),
    (F.conv_transpose2d, (2, 4, 5, 5), (4, 3, 3, 3), {"stride": 2, "output_padding": 1}),
]
SIDES = [(True, True, True), (False, True, True), (True, False, False), (False, False, True)]


@pytest.mark.parametrize(("conv", "x", "w", "kw"), CONVS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("side", [*SIDES, (True, True, None), (False, True, None)], ids=str)
def test_convolutions_are_autograds_bit_for_bit(conv, x, w, kw, side) -> None:
    """A convolution with a tangent on any of input, weight and bias (None: no bias), in
    float32 on the kernels the engine runs: the very numbers of autograd's rule."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(x, generator=gen), torch.randn(w, generator=gen)
    b = torch.randn(w.shape[1] if conv is F.conv_transpose2d else w.shape[0], generator=gen)
    args, side = ((x, w), side[:2]) if side[2] is None else ((x, w, b), side)
    _both(lambda *a: conv(*a, **kw), *args, tangents=side, tol=0)


def _mask(kind: str, rows: int, cols: int) -> Tensor | None:
    gen = torch.Generator().manual_seed(3)
    if kind == "bool":
        keep = torch.rand(2, 1, rows, cols, generator=gen) > 0.3
        keep[0, 0, 1] = False  # a row of no key: zeros, as SDPA gives
        return keep
    if kind == "float":
        return torch.randn(2, 1, rows, cols, generator=gen, dtype=torch.float64)
    return None


@pytest.mark.parametrize(
    ("mask", "causal"), [(None, False), (None, True), ("bool", False), ("float", False)]
)
@pytest.mark.parametrize(
    "tangents",
    [(True, True, True), (True, False, False), (False, True, False), (False, False, True)],
    ids=str,
)
def test_attention_is_autograds(mask, causal, tangents) -> None:
    q, k, v = (torch.randn(2, 3, 4, 5, dtype=torch.float64) for _ in range(3))
    m = _mask(mask, 4, 4)
    _both(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal),
        q,
        k,
        v,
        tangents=tangents,
    )


def test_attention_of_grouped_heads_and_a_scale_is_autograds() -> None:
    """Two key and value heads serving four query heads, keys longer than queries."""
    q = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 6, 5, dtype=torch.float64) for _ in range(2))
    _both(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True),
        q,
        k,
        v,
        tangents=(True, True, True),
    )


@pytest.mark.parametrize("side", [(True, True), (True, False), (False, True)], ids=str)
def test_grouped_products_are_each_groups_own(side) -> None:
    """``torch._grouped_mm`` of rows by 3 groups (one empty, a row past the last), which has
    no rule of autograd's: value and tangent against each group's products in float64."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(7, 4, generator=gen), torch.randn(3, 4, 8, generator=gen)
    a_t, b_t = torch.randn(7, 4, generator=gen), torch.randn(3, 4, 8, generator=gen)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    with torch.no_grad(), fwAD.dual_level(), Tangents():
        x = fwAD.make_dual(a, a_t) if side[0] else a
        w = fwAD.make_dual(b, b_t) if side[1] else b
        value, tangent = fwAD.unpack_dual(torch._grouped_mm(x, w, offs=offs))
    want, want_t = torch.zeros(6, 8, dtype=torch.float64), torch.zeros(6, 8, dtype=torch.float64)
    for g, (lo, hi) in enumerate([(0, 2), (2, 2), (2, 6)]):
        want[lo:hi] = a[lo:hi].double() @ b[g].double()
        if side[0]:
            want_t[lo:hi] += a_t[lo:hi].double() @ b[g].double()
        if side[1]:
            want_t[lo:hi] += a[lo:hi].double() @ b_t[g].double()
    torch.testing.assert_close(value[:6].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tangent[:6].double(), want_t, rtol=1e-5, atol=1e-5)


class Routed(nn.Module):
    """A Linear, a block of grouped experts (``grouped_mm``, float32 only) and a head."""

    def __init__(self, experts: moe_models.Experts):
        super().__init__()
        width = moe_models.H
        self.inp, self.block = nn.Linear(width, width), moe_models.Block(experts)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.inp(x)).mean(1))


def test_routed_experts_score_by_forward_mode_to_the_loops_answers() -> None:
    """The jvp engine all the way through grouped experts, each example's inner product with
    each reference example's gradient against the float64 loop over the same model with the
    experts' eager loop (``LoopExperts``: the same weights, ``F.linear`` per expert)."""
    torch.manual_seed(0)
    model = Routed(moe_models.Experts()).eval()
    oracle = Routed(moe_models.LoopExperts())
    oracle.load_state_dict(model.state_dict(), strict=False)
    x, y = torch.randn(4, 5, moe_models.H), torch.randint(0, 3, (4,))
    refs = ((torch.randn(2, 5, moe_models.H),), torch.randint(0, 3, (2,)))
    expected, g_norm, r_norm = reference_influence(oracle, (x,), y, refs, "cross_entropy", True)
    with Engine(model, resolve_loss("cross_entropy")) as core:
        scorer = Influence(core, reference_gradients(core, [refs], True), "jvp", norms=False)
        inner = scorer((x,), y).inner
    assert scorer.method == "jvp", scorer.note
    assert ((inner - expected).abs() / (g_norm[:, None] * r_norm)).max().item() < 1e-5
