"""Hooks of the user's own: on a parameter's gradient (a mask, a scale), and on modules where
they run inside a hooked call (a global module hook, a hook put before the Engine's), present
from the first batch or added between batches. Each batch of one Engine is exact against the
loop on the model itself (a deep copy, as ``reference_norms`` makes, drops tensor hooks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from oracle import assert_rel_close, model_state
from project import cli_norms
from torch import Tensor, nn

import gradscope
from gradscope.engine import FALLBACK_LOOP, Engine, naive_grads, total
from gradscope.errors import ModelError
from gradscope.losses import resolve_loss

D, CLASSES, BATCH = 6, 3, 5
LOSS = resolve_loss("cross_entropy")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, CLASSES)).double()


def _batch(k: int) -> tuple[tuple[Tensor], Tensor]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    return (x,), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _loop_norms(model: nn.Module, inputs: tuple[Tensor], targets: Tensor) -> Tensor:
    """The loop on ``model`` itself, its hooks run on each example's backward."""
    names = [name for name, _ in model.named_parameters()]
    grads = naive_grads(model, inputs, targets, LOSS, names)[1]
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def _masked_gradient(model: nn.Sequential) -> Callable[[], object]:
    """Train the head's first output row at twice the rate and its last not at all, as a mask
    on its gradient does (new token embeddings trained alone)."""
    mask = torch.tensor([[2.0], [1.0], [0.0]], dtype=torch.float64)
    return model[2].weight.register_hook(lambda g: g * mask).remove


def _global_hook(model: nn.Sequential) -> Callable[[], object]:
    """A hook on every module's output, the first Linear's scaled by the head's weight: it runs
    inside the Linear's call, before the Engine's own hook on it."""

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor | None:
        return out * model[2].weight.sum() if module is model[0] else None

    return nn.modules.module.register_module_forward_hook(hook).remove


def _first_hook(model: nn.Sequential) -> Callable[[], object]:
    """The same scale as the first Linear's forward hook put before the Engine's."""
    scale = model[0].register_forward_hook(
        lambda module, args, out: out * model[2].bias.sum(), prepend=True
    )
    return scale.remove


HOOKS = {"gradient mask": _masked_gradient, "global": _global_hook, "first": _first_hook}


@pytest.mark.parametrize("added", [0, 1])
@pytest.mark.parametrize("hook", HOOKS)
def test_each_batch_of_one_engine_is_exact_with_a_hook_of_the_users(hook: str, added: int):
    """The hook on from batch ``added`` through batch 2, off again for batch 3: every batch
    exact against the loop, whether the program of a batch without it held already."""
    model = _model()
    remove = None
    with Engine(model, LOSS) as engine:
        for k in range(4):
            if k == added:
                remove = HOOKS[hook](model)
            if k == 3:
                remove()
            inputs, targets = _batch(k)
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            assert_rel_close(norms, _loop_norms(model, inputs, targets), 1e-9)


def masked() -> nn.Sequential:
    """The CLI's factory: the model with the mask on its head's gradient."""
    model = _model()
    _masked_gradient(model)
    return model


def test_a_cli_run_over_a_model_with_a_hooked_gradient_is_exact(tmp_path):
    """The factory registers the mask, as a model's own code may: two batches of one shape,
    each exact against the loop on the model the factory builds."""
    model, batches = masked(), [_batch(k) for k in range(2)]
    scores = cli_norms(tmp_path, model, "test_user_hooks:masked", batches)
    for got, (inputs, targets) in zip(scores, batches, strict=True):
        assert_rel_close(got, _loop_norms(model, inputs, targets), 1e-9)


def test_fresh_calls_on_two_batches_with_a_hooked_gradient_are_exact_and_keep_the_model():
    model = masked()
    before = model_state(model)
    for k in range(2):
        inputs, targets = _batch(k)
        norms = gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
        assert_rel_close(norms, _loop_norms(model, inputs, targets), 1e-9)
        before.assert_kept(model)


def test_a_parameter_whose_gradient_is_hooked_is_served_by_the_loop_and_says_why():
    model = _model()
    remove = _masked_gradient(model)
    inputs, targets = _batch(0)
    with Engine(model, LOSS) as engine:
        engine.norms(inputs, targets)
        hooked = engine.plan.find("2.weight")
    assert hooked.rule == FALLBACK_LOOP
    assert "hook on its gradient" in hooked.note
    norms = gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
    assert_rel_close(norms, _loop_norms(model, inputs, targets), 1e-9)
    remove()


@pytest.mark.parametrize("engine", ["hooks", "jvp"])
def test_influence_with_a_hooked_gradient_is_exact(engine: str):
    """Forward mode cannot run a hook on a gradient: the jvp engine gives way to the hooks."""
    model = _model()
    remove = _masked_gradient(model)
    (x,), y = _batch(0)
    (rx,), ry = _batch(1)
    got = gradscope.per_example_influence(model, x, y, rx, ry, "cross_entropy", engine=engine)
    names = [name for name, _ in model.named_parameters()]
    ref = naive_grads(model, (rx,), ry, LOSS, names)[1]
    grads = naive_grads(model, (x,), y, LOSS, names)[1]
    expected = sum((grads[n].flatten(1) @ ref[n].mean(0).flatten()) for n in names)
    assert_rel_close(got, expected, 1e-9)
    remove()


def test_an_error_in_the_models_backward_is_one_line_naming_it():
    """A hook of the user's that raises in the backward: a ModelError naming what it raised,
    the model left as it was."""
    model = _model()

    def refuse(grad: Tensor) -> Tensor:
        raise ValueError("no gradient here")

    def hooked(module: nn.Module, args: tuple, out: Tensor) -> None:
        if out.requires_grad:  # gradscope runs some forwards without gradients
            out.register_hook(refuse)

    model[2].register_forward_hook(hooked)
    before = model_state(model)
    with pytest.raises(ModelError, match="the model's backward raised ValueError: no"):
        gradscope.per_example_norms(model, *_batch(0), loss="cross_entropy")
    before.assert_kept(model)


class CheckpointedScale(nn.Module):
    """A parameter read directly inside a non-reentrant checkpoint block."""

    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(5, 5), nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.randn(5))

    def block(self, h: Tensor) -> Tensor:
        return torch.tanh(self.inner(h)) * self.scale

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def test_a_checkpoints_recompute_of_a_read_parameter_is_one_line_with_its_cause():
    """torch's CheckpointError spans twenty lines of tips about torch.compile; the line says
    what gradscope's forward does that the recompute does not, and the ways around it."""
    x, y = torch.randn(6, 4, 5), torch.randint(0, 3, (6, 4))
    with pytest.raises(ModelError, match="read directly inside a non-reentrant") as raised:
        gradscope.per_example_norms(CheckpointedScale(), x, y, loss="cross_entropy")
    assert "torch.compile" not in str(raised.value) and "\n" not in str(raised.value)


def test_an_error_of_gradscopes_own_in_the_backward_goes_on_as_it_is(monkeypatch):
    """An error raised in gradscope's code that runs inside the backward (its hooks hand each
    output gradient to the rules) is gradscope's, not the model's: not relabelled."""
    from gradscope.engine.backward import serve

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of gradscope's")

    monkeypatch.setattr(serve, "_on_grad", broken)  # each call's output gradient's rule
    with pytest.raises(RuntimeError, match="a bug of gradscope's") as raised:
        gradscope.per_example_norms(_model(), *_batch(0), loss="cross_entropy")
    assert not isinstance(raised.value, ModelError)


def _scaled(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
    return out * 2


def _flipped(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
    """The rows of the batch reversed: each example's row is another's, in as many autograd
    nodes as ``_scaled`` makes."""
    return out.flip(0)


def _swap_hook(model: nn.Sequential, handle) -> None:
    handle.remove()
    model[1].register_forward_hook(_flipped)


def _swap_class(model: nn.Sequential, handle) -> None:
    class Flipped(nn.Tanh):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x).flip(0)

    handle.remove()
    model[1].__class__ = Flipped


@pytest.mark.parametrize("swap", [_swap_hook, _swap_class])
def test_a_hook_or_class_swapped_between_calls_is_seen_as_on_a_fresh_model(swap):
    """A program replays only the model it was analysed on: a hook swapped for one of as many
    nodes, or a module's class changed in place, that now mixes the examples is refused as on
    a model met for the first time, not replayed into numbers."""
    model = _model()
    handle = model[1].register_forward_hook(_scaled)
    for k in range(2):  # analysed, then replayed
        inputs, targets = _batch(k)
        norms = gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")
        assert_rel_close(norms, _loop_norms(model, inputs, targets), 1e-9)
    swap(model, handle)
    inputs, targets = _batch(2)
    with pytest.raises(ModelError, match="mixes the examples"):
        gradscope.per_example_norms(model, inputs, targets, loss="cross_entropy")


def test_a_hook_swapped_for_one_that_keeps_the_examples_apart_is_exact():
    model = _model()
    handle = model[1].register_forward_hook(_scaled)
    with Engine(model, LOSS) as engine:
        for k in range(3):
            if k == 2:
                handle.remove()
                model[1].register_forward_hook(lambda module, args, out: out * 3)
            inputs, targets = _batch(k)
            norms = total(engine.norms(inputs, targets).norm_sq).sqrt()
            assert_rel_close(norms, _loop_norms(model, inputs, targets), 1e-9)


def test_a_module_replaced_under_a_held_engine_is_refused_in_one_line():
    """The Engine's plan names the parameters it was made with: a head replaced since would
    be left out of every norm (its old parameters' zeros), so the batch is refused."""
    model = _model()
    with Engine(model, LOSS) as engine:
        engine.norms(*_batch(0))
        model[2] = nn.Linear(D, CLASSES).double()
        with pytest.raises(ModelError, match="make a new Engine"):
            engine.norms(*_batch(1))
