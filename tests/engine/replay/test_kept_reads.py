"""What a model keeps of a pass whose reads are intercepted (``replay/intercept.py``): the
parameter it read set as its own attribute (registered as a parameter, as a plain forward
registers it), a tensor made from one kept for the call and dropped (a cache), or kept after it
(a value logged, which the user clears; or in a list it keeps). The model holds after the pass what its own forward
would have left it, never a ``Read`` or ``Made``, its parameters the user's; the batches replay
(a tensor made from a parameter set as an attribute raised inside the forward, as a parameter
not a leaf, and every batch was analysed), each parameter's norms the float64 loop's, at the
model's top level and in a light region."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, model_state, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, Forward, naive_grads
from gradscope.engine.replay.intercept import Made, Read
from gradscope.losses import resolve_loss

D, CLASSES = 6, 3
LOSS = resolve_loss("cross_entropy")


def _scaled(module: nn.Module, name: str, how: str) -> Tensor:
    """``module``'s parameter ``name`` as the forward reads it: kept as another attribute
    (``param``), made into a tensor kept for the call (``cache``) or after it (``logged``, or
    in a list: ``listed``)."""
    if how == "param":
        module.kept = getattr(module, name)
        return module.kept
    if how == "cache":
        module.cache = getattr(module, name).exp()
        scale, module.cache = module.cache, None
        return scale
    if how == "logged":
        module.logged = getattr(module, name).exp()
        return module.logged
    if how == "listed":  # in a list the module keeps
        module.listed.append(getattr(module, name).exp())
        return module.listed[-1]
    return getattr(module, name)


class Scale(nn.Module):
    """A LayerScale: ``gamma`` broadcast along the tokens, a light region's read."""

    def __init__(self, how: str | None):
        super().__init__()
        self.fc, self.gamma, self.how = nn.Linear(D, D), nn.Parameter(torch.ones(D)), how
        self.listed: list[Tensor] = []

    def forward(self, h: Tensor) -> Tensor:
        return h + _scaled(self, "gamma", self.how) * self.fc(h)


class Model(nn.Module):
    """``scale`` read at the top level (the root's read), the block's ``gamma`` in its call;
    ``how`` the way one of them (``where``) is kept."""

    def __init__(self, how: str, where: str):
        super().__init__()
        self.emb, self.head = nn.Linear(4, D), nn.Linear(D, CLASSES)
        self.block = Scale(how if where == "block" else None)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.how, self.listed = how if where == "root" else None, []

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 4)
        return self.head(self.block(self.emb(x)) * _scaled(self, "scale", self.how)).mean(1)

    def clear(self) -> None:
        """What the user does after reading a logged value."""
        for m in (self, self.block):
            m.logged = None
            m.listed.clear()


def _batch(seed: int, n: int = 3) -> tuple[tuple[Tensor, ...], Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 5, 4, generator=g, dtype=torch.float64),), torch.arange(n) % CLASSES


def _assert_given_back(model: Model, params: dict[str, nn.Parameter]) -> None:
    """No module holds a ``Read`` or ``Made``; every parameter the user's own object (``kept``
    the one it was set to); a logged value the tensor the forward made."""
    for m in model.modules():
        for d in (m._parameters, m._buffers, vars(m)):
            assert not any(type(v) in (Read, Made) for v in d.values()), (type(m), d.keys())
    named = dict(model.named_parameters(remove_duplicate=False))
    for name, p in named.items():
        assert p is params[name.replace("kept", "gamma" if "block" in name else "scale")]
    for m, name in ((model, "scale"), (model.block, "gamma")):
        for logged in [vars(m).get("logged"), *m.listed]:
            if logged is not None:
                assert type(logged) is Tensor
                assert torch.equal(logged, getattr(m, name).exp())


HOWS = ("param", "cache", "logged", "listed")
CASES = [(how, where) for how in HOWS for where in ("root", "block")]


@pytest.mark.parametrize(("how", "where"), CASES)
def test_what_a_model_keeps_of_a_replayed_pass_is_its_own(how, where, intercepted):
    torch.manual_seed(0)
    model = Model(how, where).double()
    params = dict(model.named_parameters())
    engine = Engine(model, LOSS)
    with engine:
        for seed in range(5):
            inputs, targets = _batch(seed)
            got = engine.norms(inputs, targets).norm_sq
            _assert_given_back(model, params)
            _, grads = naive_grads(model, inputs, targets, LOSS, list(params), Forward())
            for name, g in grads.items():
                assert_rel_close(got[name], g.flatten(1).pow(2).sum(1), 1e-9)
            model.clear()
    findings = engine.record.at(*_batch(0))
    assert findings.replays == 3, findings.why  # after the first two: the second sets it
    assert intercepted and all(intercepted), intercepted
    assert not engine.record.moded


@pytest.mark.parametrize(("how", "where"), CASES)
def test_fresh_calls_leave_the_model_as_its_forward_does(how, where):
    """By ``per_example_norms``, a call a batch (of 3, then of 1): the model as the call found
    it, its forward's own attributes aside."""
    torch.manual_seed(0)
    model = Model(how, where).double()
    params = dict(model.named_parameters())
    for seed, n in ((0, 3), (1, 3), (2, 3), (3, 1), (4, 1), (5, 1)):
        inputs, targets = _batch(seed, n)
        with torch.no_grad():
            model(*inputs)  # what its forward sets (``kept`` registered)
        model.clear()
        state = model_state(model)
        got = gradscope.per_example_norms(model, inputs, targets)
        state.assert_kept(model)
        _assert_given_back(model, params)
        model.clear()  # a tensor not a leaf: the loop's deep copy would refuse it
        assert_rel_close(got, reference_norms(model, inputs, targets, "cross_entropy")[1], 1e-9)
    record = Engine(model, LOSS).record  # the calls' record, kept for the model
    assert [f.replays for f in record.signatures.values()] == [2, 2]  # of 3, of 1
