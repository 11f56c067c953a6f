"""Every engine path leaves the user's model as it was (the same Parameter objects under every
name, ``requires_grad``, values, buffers, modes, no ``.grad``), also where one submodule is
registered under two paths; and forward mode keeps the losses' tangents where a fitted
classifier's softmax has saturated."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_rel_close, model_state, reference_influence, reference_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import Engine, influence_errors, total
from gradscope.engine.analysis.selfcheck import tolerance
from gradscope.errors import GradscopeError
from gradscope.losses import resolve_loss

D, CLASSES, BATCH = 6, 3, 5


class TwoPaths(nn.Module):
    """One block registered under two paths (x-transformers' ``tie_token_emb``, TabNet's shared
    GLU layers), called at both; and a per-feature gain read through ``torch.mm``, which only
    the vmap fallback serves."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(D, D)
        self.first, self.second = shared, shared
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.second(torch.tanh(self.first(x))))
        return self.head(torch.mm(h, torch.diag(self.gain)))


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def test_an_entered_engine_hooks_the_model_once_and_leaves_no_hook():
    """The module hooks go on when the Engine is entered and come off when the outermost
    ``with`` is left, not on every batch; a forward of the model between passes runs through
    them and is captured by none."""
    torch.manual_seed(0)
    model = TwoPaths().double()
    before = model_state(model)

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    engine = Engine(model, resolve_loss("cross_entropy"))
    with engine:
        on = hooks()
        assert on > 0
        for seed in range(3):
            x, y = _batch(seed)
            got = total(engine.norms((x,), y).norm_sq).sqrt()
            assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
            assert hooks() == on
            with engine:  # entered again inside its own ``with``
                assert hooks() == on
            assert hooks() == on
        with pytest.raises(GradscopeError):  # a forward that fails half way
            engine.norms((x[:, :2],), y)
        got = total(engine.norms((x,), y).norm_sq).sqrt()  # the hooks still serve a pass
        assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
    before.assert_kept(model)
    assert engine.record.at((x,), y).replays == 3


def test_an_exit_without_its_enter_is_refused_and_the_engine_still_serves():
    """``__exit__`` unmatched, before any ``with`` and after one, is a RuntimeError naming the
    ``with``; the Engine's hooks are not thrown out of count by it: the next ``with`` hooks the
    model, serves exact norms and leaves the model as it was."""
    torch.manual_seed(0)
    model = TwoPaths().double()
    before = model_state(model)
    engine = Engine(model, resolve_loss("cross_entropy"))
    with pytest.raises(RuntimeError, match=r"without a matching __enter__.*with Engine\("):
        engine.__exit__(None, None, None)
    with engine:
        pass
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        engine.__exit__(None, None, None)
    x, y = _batch(0)
    with engine:
        got = total(engine.norms((x,), y).norm_sq).sqrt()
    assert_rel_close(got, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)
    before.assert_kept(model)


@pytest.mark.parametrize("engine", ["jvp", "hooks"])
def test_a_block_at_two_paths_is_kept_and_every_batch_exact(engine: str):
    torch.manual_seed(0)
    model = TwoPaths().double()
    ref = _batch(9)
    for seed in range(3):
        x, y = _batch(seed)
        before = model_state(model)
        infl = gradscope.per_example_influence(model, x, y, ref[0], ref[1], engine=engine)
        before.assert_kept(model)
        norms = gradscope.per_example_norms(model, x, y)
        before.assert_kept(model)
        expected, _, _ = reference_influence(model, (x,), y, ((ref[0],), ref[1]), "cross_entropy")
        assert_rel_close(infl, expected[:, 0], 1e-9)
        assert_rel_close(norms, reference_norms(model, (x,), y, "cross_entropy")[1], 1e-9)


def _fitted(dtype: torch.dtype) -> tuple[nn.Module, Tensor, Tensor]:
    """A tabular MLP that fits its data: every softmax saturated, the target's probability 1 in
    the dtype's rounding, the others' small but not 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, CLASSES)).to(dtype)
    x = torch.randn(64, 4, dtype=dtype)
    with torch.no_grad():
        model[2].weight.mul_(60 if dtype == torch.float32 else 200)
        logits = model(x)
    y = logits.argmax(1)
    p = logits.softmax(1)
    saturated = (p.gather(1, y[:, None])[:, 0] == 1) & ((p > 0).sum(1) == CLASSES)
    assert int(saturated.sum()) >= 4  # 1 - p is 0 in the dtype; the others' p are not
    return model, x[saturated], y[saturated]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_forward_mode_keeps_a_saturated_loss(dtype: torch.dtype):
    """Forward mode through cross entropy cancels to 0 where p - 1 is 0 in the dtype; the
    tangent read off the loss's backward keeps the small probabilities, as the loop does:
    ``gradscope check``'s jvp row (in units of ||g_i|| ||g_ref||, against the loop in the
    model's dtype) passes, and float64 matches the float64 loop."""
    model, x, y = _fitted(dtype)
    ref = (x[:4] + 0.3, y[:4])
    engine = Engine(model, resolve_loss("cross_entropy"))
    errors = influence_errors(engine, (x,), y, (ref[0],), ref[1])
    assert errors["jvp"] <= tolerance(dtype) and errors["hooks"] <= tolerance(dtype), errors
    if dtype == torch.float64:
        expected, _, _ = reference_influence(model, (x,), y, ((ref[0],), ref[1]), "cross_entropy")
        jvp = gradscope.per_example_influence(model, x, y, *ref, engine="jvp")
        assert_rel_close(jvp, expected[:, 0], 1e-9)
