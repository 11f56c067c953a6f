"""Reference directions laid out stacked once (``backward/stacked.py``): alike parameters'
references rows of one tensor, last first, which the passes answering several parameters'
inner products together read as one without a copy; exact against the float64 loop."""

from __future__ import annotations

import torch
from oracle import assert_rel_close
from torch import nn

from gradscope.engine import Engine, Want, naive_grads, reference_gradients
from gradscope.engine.backward.stacked import laid_out
from gradscope.losses import resolve_loss
from gradscope.rules import base, outer, routed
from gradscope.rules.base import stacked


def test_alike_parameters_are_laid_out_as_rows_of_one_tensor_last_first():
    params = [torch.empty(3, 2), torch.empty(5), torch.empty(3, 2), torch.empty(3, 2).double()]
    params.append(torch.empty(3, 2))
    out = laid_out(params)
    assert [tuple(t.shape) for t in out] == [(1, *p.shape) for p in params]
    assert all(t.dtype == p.dtype and not t.any() for t, p in zip(out, params, strict=True))
    float32 = [out[4], out[2], out[0]]  # the last first: the order the backward reaches them
    view = stacked(float32)
    assert view.data_ptr() == out[4].data_ptr() and torch.equal(view, torch.stack(float32))
    twin = laid_out(params)[2].fill_(1)  # where out[2] lies, in another tensor
    block = torch.zeros(2, 1, 3, 2)
    before = block[0]
    block.data = torch.ones(2, 1, 3, 2)  # one base, another storage: before's rows stay zeros
    cases = (
        [out[0], out[2], out[4]],
        [out[4], out[0]],
        [out[3], out[2]],
        [out[1]],
        [out[4], twin],
        [before, block[1]],
    )
    for others in cases:  # another order, a gap, another dtype, one tensor, another tensor or
        copy = stacked(others)  # storage: stacked anew
        assert torch.equal(copy, torch.stack(others))
        assert all(copy.data_ptr() != t.data_ptr() for t in others) or len(others) == 1


class Tower(nn.Module):
    """Alike Linears of an odd width, one called twice and tied to another."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(5, 5) for _ in range(4))
        self.twice = nn.Linear(5, 5)
        self.tied = nn.Linear(5, 5)
        self.tied.weight = self.twice.weight
        self.head = nn.Linear(5, 1)

    def forward(self, x):
        for layer in [*self.layers, self.twice, self.twice]:
            x = torch.tanh(layer(x))
        return self.head(self.tied(x)).squeeze(-1).sum(-1)


def test_inner_products_with_laid_out_references_read_them_without_a_copy(monkeypatch):
    torch.manual_seed(0)
    model = Tower().double()
    loss = resolve_loss("mse")
    views = []

    def spy(tensors):
        out = stacked(tensors)
        views.append(out.data_ptr() == tensors[0].data_ptr())
        return out

    for module in (base, outer, routed):  # where the rules read their references stacked
        monkeypatch.setattr(module, "stacked", spy)
    for batch in (1, 3):
        x, y = torch.randn(batch, 7, 5).double(), torch.randn(batch).double()
        rx, ry = torch.randn(4, 7, 5).double(), torch.randn(4).double()
        with Engine(model, loss) as engine:
            names = [p.name for p in engine.plan.included]
            refs = reference_gradients(engine, [((rx[:3],), ry[:3]), ((rx[3:],), ry[3:])])
            want = Want(norms=False, refs=refs)
            got = [engine.scores((x,), y, want).inner for _ in range(2)]  # analysed, replayed
        _, ref_grads = naive_grads(model, (rx,), ry, loss, names)
        _, grads = naive_grads(model, (x,), y, loss, names)
        for name in names:
            mean = ref_grads[name].mean(0, keepdim=True)
            assert_rel_close(refs[name], mean, 1e-12)
            for inner in got:
                assert_rel_close(inner[name], grads[name].flatten(1) @ mean.flatten(1).T, 1e-9)
    assert any(views)
