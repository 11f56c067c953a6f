"""Reads of a tensor made from parameters, intercepted (``replay/intercept.py``): a dual
encoder's ``logit_scale.exp()`` scaling its (B, B) similarity at the model's top level, and a
cross-attention ``nn.MultiheadAttention`` (query from one stream, key and value from another:
its packed weight read as slices) replay every batch after the first with no torch function
mode over them, each parameter's norms the float64 loop's. A tensor made with constants too (a
buffer, an ``arange``) keeps the mode, whose witness sees the ops that make those; one the
model reaches by another way than its modules' attributes fails the witness, is analysed, and
the mode serves its kind after."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads
from gradscope.losses import resolve_loss

D, CLASSES = 8, 3


class DualEncoder(nn.Module):
    """CLIP's head: two towers, their (B, B) cosine similarity scaled by ``exp(logit_scale)``
    (SigLIP's plus ``logit_bias``), each example's logits from its own pair, on the diagonal."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.image, self.text = nn.Linear(6, D), nn.Linear(5, D)
        self.logit_scale = nn.Parameter(torch.tensor(2.5).log())
        self.logit_bias = nn.Parameter(torch.tensor(-1.0)) if bias else None
        self.head = nn.Linear(1, CLASSES)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:  # (B, 6), (B, 5)
        a = F.normalize(self.image(x), dim=-1)
        b = F.normalize(self.text(y), dim=-1)
        logits = b @ a.T * self.scale()  # (B, B)
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        return self.head(logits.diagonal()[:, None])  # example i's own pair

    def scale(self) -> Tensor:
        return self.logit_scale.exp().clamp(max=100)


class ScaledByBuffer(DualEncoder):
    """The scale made with a buffer too: a constant the mode must see made."""

    def __init__(self):
        super().__init__()
        self.register_buffer("temperature", torch.tensor(0.5, dtype=torch.float64))

    def scale(self) -> Tensor:
        return self.logit_scale.exp() * self.temperature.double()


class KeptScale(DualEncoder):
    """The scale read through a list the model kept: no ``Read`` stands where it is read."""

    def __init__(self):
        super().__init__()
        self.kept = [self.logit_scale]

    def scale(self) -> Tensor:
        return self.kept[0].exp()


class CrossAttention(nn.Module):
    """Queries from one stream, keys and values from another: ``nn.MultiheadAttention``
    reads its packed weight's query rows and key-value rows as slices (``in_proj_weight``
    split); with ``probe``, the query is a learned token repeated over the batch (SigLIP's
    attention-pooling head)."""

    def __init__(self, probe: bool = False, batch_first: bool = True):
        super().__init__()
        self.first = batch_first
        self.q, self.kv = nn.Linear(6, D), nn.Linear(5, D)
        self.probe = nn.Parameter(torch.randn(1, 1, D)) if probe else None
        self.attn = nn.MultiheadAttention(D, 2, batch_first=batch_first)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:  # (B, 3, 6), (B, 4, 5)
        q, kv = self.q(x), self.kv(y)
        if self.probe is not None:
            q = self.probe.repeat(kv.shape[0], 1, 1)
        if not self.first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out = self.attn(q, kv, kv, need_weights=False)[0]
        return self.head(out.mean(1 if self.first else 0))


def _batches(model: nn.Module, b: int, n: int = 4) -> list:
    cross = isinstance(model, CrossAttention)
    shapes = [(b, 3, 6), (b, 4, 5)] if cross else [(b, 6), (b, 5)]
    return [
        (tuple(torch.randn(*s, dtype=torch.float64) for s in shapes), torch.arange(b) % CLASSES)
        for _ in range(n)
    ]


def _loop(model: nn.Module, inputs: tuple, targets: Tensor) -> dict[str, Tensor]:
    """Each parameter's (B,) squared per-example gradient norms from the float64 loop."""
    names = [n for n, _ in model.named_parameters()]
    _, grads = naive_grads(model, inputs, targets, resolve_loss("cross_entropy"), names, Forward())
    return {n: g.reshape(len(g), -1).pow(2).sum(1) for n, g in grads.items()}


def _run(model: nn.Module, batches: list) -> Engine:
    """Each batch's per-parameter norms through one Engine, checked against the loop."""
    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        for inputs, targets in batches:
            got = engine.norms(inputs, targets).norm_sq
            expected = _loop(model, inputs, targets)
            assert set(got) == set(expected)
            for name, want in expected.items():
                assert_rel_close(got[name], want, 1e-9)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # given back
    return engine


@pytest.mark.parametrize(
    "make",
    [
        DualEncoder,
        lambda: DualEncoder(bias=True),
        CrossAttention,
        lambda: CrossAttention(batch_first=False),
        lambda: CrossAttention(probe=True),
    ],
    ids=["clip", "siglip", "cross", "cross-sequence-first", "probe"],
)
@pytest.mark.parametrize("b", [3, 1])
def test_reads_of_tensors_made_from_parameters_alone_are_intercepted(make, b, intercepted):
    torch.manual_seed(0)
    model = make().double()
    engine = _run(model, _batches(model, b))
    findings = engine.record.at(*_batches(model, b, 1)[0])
    assert findings.replays >= 2, findings.why
    assert intercepted and all(intercepted), intercepted
    assert not engine.record.moded


def test_a_tensor_made_with_a_buffer_keeps_the_mode(intercepted):
    """``exp(logit_scale) * temperature.double()``: the cast of the buffer is an op on no
    parameter, which an intercepting region would not see; the recipe says constants made
    it, so the read is served under the mode, every batch after the first replayed."""
    torch.manual_seed(0)
    model = ScaledByBuffer().double()
    engine = _run(model, _batches(model, 3))
    assert engine.record.at(*_batches(model, 3, 1)[0]).replays == 3
    assert intercepted and not any(intercepted)


def test_a_scale_the_modules_do_not_hold_is_analysed_then_left_to_the_mode(intercepted):
    """Read through a list: intercepted, the scale's read is not seen, the witness fails
    (fewer reads), the batch is analysed, exact; the top level is read under the mode after."""
    torch.manual_seed(0)
    model = KeptScale().double()
    engine = _run(model, _batches(model, 3))
    findings = engine.record.at(*_batches(model, 3, 1)[0])
    assert engine.record.moded == {None}
    assert (findings.replays, findings.analyses) == (2, 2)
    assert intercepted[0] and not any(intercepted[1:])
