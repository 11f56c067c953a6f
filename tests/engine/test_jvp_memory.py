"""The forward-mode engine holds a few layers' values at a time: no autograd graph, no tangent
kept past the layer that reads it, and the answers still the float64 loop's."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from oracle import reference_influence
from peaks import NewBytes
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from gradscope.engine import Engine, Influence, jvp, reference_gradients
from gradscope.engine.jvp import composite_attention
from gradscope.engine.tangents import Tangents
from gradscope.losses import resolve_loss

TOL = 1e-6  # |delta influence| / (||g_i|| ||g_ref||), in float64


class SelfAttention(nn.Module):
    """nn.MultiheadAttention with a residual: its fused inference kernel lacks forward mode, so
    the engine takes the composite path."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.att(h, h, h, need_weights=False)[0]


def deep(attention: bool) -> nn.Sequential:
    """Six Linear+Tanh layers of width 8, after a self-attention block with ``attention``."""
    layers = [m for _ in range(6) for m in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(*([SelfAttention()] if attention else []), *layers)


def _scored(model: nn.Module, x: Tensor, during, per_ref: bool = False) -> Influence:
    """The jvp scorer on ``model`` after a first call; its second call, run inside ``during``,
    checked against the loop (``per_ref``: three directions, one per reference example)."""
    y = torch.randint(0, 3, x.shape[:-1])  # a class per example, or per position
    refs = ((x[:3] + 0.5,), y[:3])
    expected, g_norm, r_norm = reference_influence(model, (x,), y, refs, "cross_entropy", per_ref)
    core = Engine(model, resolve_loss("cross_entropy"))
    with core:
        directions = reference_gradients(core, [refs], per_ref)
        scorer = Influence(core, directions, "jvp", norms=False)
        scorer((x,), y)
        with during:
            inner = scorer((x,), y).inner
    assert scorer.method == "jvp"
    assert ((inner - expected).abs() / (g_norm[:, None] * r_norm)).max().item() < TOL
    return scorer


PATHS = pytest.mark.parametrize("attention", [False, True], ids=["plain", "composite"])


def _inputs(attention: bool) -> Tensor:
    return torch.randn(5, 3, 8, dtype=torch.float64) if attention else torch.randn(5, 8).double()


@PATHS
def test_jvp_records_no_autograd_graph(attention: bool, monkeypatch) -> None:
    """Nothing of the model's forward is saved for a backward that never comes: only the
    loss's own, whose backward gives the losses' derivative (``jvp.loss_tangent``)."""
    torch.manual_seed(0)
    saved, in_loss = [], [False]
    tangent = jvp.loss_tangent

    def marked(*args):
        in_loss[0] = True
        try:
            return tangent(*args)
        finally:
            in_loss[0] = False

    monkeypatch.setattr(jvp, "loss_tangent", marked)
    hooks = torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(in_loss[0]) or t, lambda t: t
    )
    scorer = _scored(deep(attention).double(), _inputs(attention), hooks)
    assert saved and all(saved)  # the loss's, and nothing else
    assert (scorer.note is not None) == attention  # the fused kernel was stepped around


@PATHS
def test_jvp_frees_each_layer_after_the_next_has_read_it(attention: bool) -> None:
    """When the last layer runs, the values and tangents of every layer but the last two are
    gone, those of the previous direction's pass too: the peak is a few layers' worth."""
    torch.manual_seed(0)
    model = deep(attention).double()
    refs: list[list[StorageWeakRef]] = []
    alive_at_end: list[int] = []

    def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
        primal, tangent = fwAD.unpack_dual(out)
        if tangent is None:  # the hook pass of the reference gradients, not forward mode
            return
        refs.append([StorageWeakRef(t.untyped_storage()) for t in (primal, tangent)])
        if module is model[-1]:
            alive_at_end.append(sum(not r.expired() for rs in refs[:-2] for r in rs))

    for m in model:
        m.register_forward_hook(hook)
    _scored(model, _inputs(attention), contextlib.nullcontext(), per_ref=True)
    # 3 directions, the second call's: the first is the hooks' pass that proves the signature
    assert len(alive_at_end) == 3 and not any(alive_at_end)


def test_composite_attention_restores_the_fast_path() -> None:
    before = torch.backends.mha.get_fastpath_enabled()
    with composite_attention():
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled() == before
    with pytest.raises(ValueError), composite_attention():
        raise ValueError
    assert torch.backends.mha.get_fastpath_enabled() == before


# (input shape, weight shape, bias?, which of x, W, b carry a tangent)
LINEAR = [
    ((6, 5), (4, 5), True, (True, True, True)),
    ((2, 3, 5), (4, 5), True, (True, True, True)),  # a sequence: (B, T, in)
    ((6, 5), (4, 5), False, (False, True, False)),  # the first layer: the input has none
    ((6, 5), (4, 5), True, (True, False, False)),  # a layer outside the selection
    ((6, 5), (4, 5), True, (False, False, True)),  # only the bias is selected
    ((5,), (4, 5), True, (True, True, True)),  # an unbatched row
    ((6, 5), (5,), False, (True, False, False)),  # a vector weight: autograd's rule
    ((6, 5), (4, 5), False, (False, False, False)),  # no tangent anywhere
]


@pytest.mark.parametrize(("x_shape", "w_shape", "bias", "tangents"), LINEAR, ids=str)
def test_linear_tangents_are_autograds(x_shape, w_shape, bias, tangents) -> None:
    """F.linear under Tangents gives forward mode's own value and tangent."""
    torch.manual_seed(0)
    b_shape = w_shape[:1] if len(w_shape) == 2 else ()
    primals = [torch.randn(s, dtype=torch.float64) for s in (x_shape, w_shape, b_shape)]
    with torch.no_grad(), fwAD.dual_level():
        args = [
            fwAD.make_dual(p, torch.randn_like(p)) if has else p
            for p, has in zip(primals, tangents, strict=True)
        ][: 3 if bias else 2]
        expected = fwAD.unpack_dual(F.linear(*args))
        with Tangents():
            got = [fwAD.unpack_dual(F.linear(*args))]
            if bias:
                got.append(fwAD.unpack_dual(F.linear(*args[:2], bias=args[2])))
    for value, tangent in got:
        torch.testing.assert_close(value, expected.primal, rtol=1e-12, atol=1e-12)
        if expected.tangent is None:
            assert tangent is None
        else:
            torch.testing.assert_close(tangent, expected.tangent, rtol=1e-12, atol=1e-12)


def test_linear_tangent_needs_no_more_than_its_output() -> None:
    """A dual F.linear makes its value and its tangent and nothing else of their size alive at
    once; autograd's rule for it holds five such tensors."""
    x, w, b = torch.randn(64, 32), torch.randn(48, 32), torch.randn(48)
    out_bytes = 64 * 48 * 4
    peaks = []
    for mode in (contextlib.nullcontext, Tangents):
        with torch.no_grad(), fwAD.dual_level():
            tangents = [torch.randn_like(t) for t in (x, w, b)]
            duals = [fwAD.make_dual(t, d) for t, d in zip((x, w, b), tangents, strict=True)]
            with mode(), NewBytes([x, w, b, *tangents]) as made:
                F.linear(*duals)
            peaks.append(made.peak / out_bytes)
    assert peaks == [5, 2]


def test_conv_tangent_needs_no_more_than_its_output() -> None:
    """A dual convolution holds its value and tangent, and in a layer past the first the
    second term of the tangent; autograd's rule holds four tensors of the output's size, and
    in the first layer convolves a zero tangent of the input's size."""
    x, w, b = torch.randn(8, 3, 12, 12), torch.randn(8, 3, 3, 3), torch.randn(8)
    out_bytes = 8 * 8 * 12 * 12 * 4
    peaks = []
    for mode in (contextlib.nullcontext, Tangents):
        for first in (True, False):
            with torch.no_grad(), fwAD.dual_level():
                tangents = [torch.randn_like(t) for t in (x, w, b)]
                duals = [fwAD.make_dual(t, d) for t, d in zip((x, w, b), tangents, strict=True)]
                with mode(), NewBytes([x, w, b, *tangents]) as made:
                    F.conv2d(x if first else duals[0], *duals[1:], padding=1)
                peaks.append(made.peak / out_bytes)
    assert peaks == [4, 4, 2, 3]
