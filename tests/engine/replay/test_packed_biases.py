"""Biases packed by ``torch.cat`` and cut again by ``chunk`` (WavLM's attention: its q, k and v
projections' biases concatenated for ``F.multi_head_attention_forward``, which chunks them into
three): each piece is one parameter exactly, so its gradient is the read's, written out
(``derived.Computed.pieces``), with no VJP through the cat and the chunk; a chunk that cuts
across the parameters goes back by one, as before. Each parameter's norms are the float64
loop's over batches replayed after the first, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_rel_close, model_state
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads, vjps
from gradscope.losses import resolve_loss

B, T, D, HEADS, CLASSES = 3, 5, 8, 2, 3
LOSS = resolve_loss("cross_entropy")


class Attention(nn.Module):
    """WavLM's ``torch_multi_head_self_attention``: separate projections, biases packed."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))

    def forward(self, h: Tensor) -> Tensor:  # (T, B, D)
        bias = torch.cat((self.q.bias, self.k.bias, self.v.bias))
        out, _ = F.multi_head_attention_forward(
            h, h, h, D, HEADS, torch.empty([0]), bias, None, None, False, 0.0,
            self.out.weight, self.out.bias, training=False, need_weights=False,
            use_separate_proj_weight=True, q_proj_weight=self.q.weight,
            k_proj_weight=self.k.weight, v_proj_weight=self.v.weight,
        )  # fmt: skip
        return out


class Uneven(nn.Module):
    """Two biases of 5 and 3 packed and cut in two halves of 4: neither half is one of them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(3))

    def forward(self, h: Tensor) -> Tensor:  # (T, B, D)
        first, second = torch.cat((self.a, self.b)).chunk(2)
        return h * torch.cat((first, second)) + first.sum() * second[0]


class Model(nn.Module):
    def __init__(self, layer: type[nn.Module]):
        super().__init__()
        self.inp, self.layers = nn.Linear(4, D), nn.ModuleList([layer(), layer()])
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4)
        h = self.inp(x).transpose(0, 1)  # (T, B, D)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h.mean(0))


@pytest.mark.parametrize(("layer", "backs"), [(Attention, 0), (Uneven, 2 * 2)])
def test_a_packed_bias_cut_again_goes_back_as_read(layer: type[nn.Module], backs: int, monkeypatch):
    calls: list = []
    back = vjps.back
    monkeypatch.setattr(vjps, "back", lambda *args: calls.append(1) or back(*args))
    torch.manual_seed(0)
    model = Model(layer).double()
    names = [n for n, _ in model.named_parameters()]
    state = model_state(model)
    with Engine(model, LOSS) as engine:
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(B, T, 4, generator=g, dtype=torch.float64)
            y = torch.randint(0, CLASSES, (B,), generator=g)
            calls.clear()
            got = engine.norms((x,), y).norm_sq
            _, grads = naive_grads(model, (x,), y, LOSS, names, Forward())
            for name, grad in grads.items():
                expected = grad.flatten(1).pow(2).sum(1)
                if name.endswith("k.bias"):  # the softmax takes no gradient to a key's bias
                    assert expected.max() < 1e-24 and got[name].max() < 1e-24
                else:
                    assert_rel_close(got[name], expected, 1e-9)
        findings = engine.record.at((x,), y)
    state.assert_kept(model)
    assert findings.replays == 3, findings.why
    assert not [p.name for p in engine.plan.params if p.is_fallback]
    assert len(calls) == backs  # the last batch's: none where each piece is a bias
