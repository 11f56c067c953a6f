"""The reference every engine number is tested against: a float64 per-example backward loop."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gradscope.engine import Engine, Forward, naive_grads, select_output
from gradscope.losses import resolve_loss


@dataclass
class Case:
    """A test problem as data: a module, inputs and targets for a batch, and a loss."""

    id: str
    module: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Tensor, ...]]  # batch size -> model inputs
    targets: Callable[[Tensor], Tensor]  # model output -> targets of the right shape
    loss: str = "mse"
    loss_kwargs: dict = field(default_factory=dict)
    batch: int = 5
    output: str | int | None = None

    def build(self, dtype: torch.dtype = torch.float64, batch: int | None = None, seed: int = 0):
        torch.manual_seed(seed)
        model = self.module().to(dtype)
        inputs = tuple(
            t.to(dtype) if t.is_floating_point() else t for t in self.inputs(batch or self.batch)
        )
        with torch.no_grad():
            model.eval()
            targets = self.targets(select_output(model(*inputs), self.output))
        return model, inputs, targets

    def __repr__(self) -> str:
        return self.id


def reference_norms(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    loss: str = "mse",
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    output: str | int | None = None,
    loss_kwargs: dict | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-example (loss, grad norm) from the loop, on a float64 copy of the model."""
    model = copy.deepcopy(model).double()
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    targets = targets.double() if targets.is_floating_point() else targets
    fn = resolve_loss(loss, loss_kwargs)
    with Engine(model, fn, include, exclude) as engine:
        losses, grads = naive_grads(
            model,
            inputs,
            targets,
            fn,
            [p.name for p in engine.plan.included],
            Forward(output=output),
        )
    norm = torch.stack([g.reshape(len(g), -1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    return losses, norm


def assert_rel_close(actual: Tensor, expected: Tensor, rtol: float) -> None:
    """max |a - e| / max(|e|) below rtol: relative to the scale of the answer, as check reports it."""
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp_min(1e-30)
    err = ((actual - expected).abs().max() / scale).item()
    assert err < rtol, (
        f"relative error {err:.3g} >= {rtol:g}\nactual   {actual}\nexpected {expected}"
    )


def reference_influence(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    refs: tuple[tuple[Tensor, ...], Tensor],
    loss: str,
    per_ref: bool = False,
    exclude: tuple[str, ...] = (),
    denominators: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(B, K) influence, (B,) ||g_i||, (K,) ||r_k|| on a float64 copy of the model: every
    gradient formed, one example at a time; the reference is the mean of the reference examples'
    gradients (or each of them with ``per_ref``), divided by ``denominators`` per parameter."""
    model = copy.deepcopy(model).double()

    def f64(ts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return tuple(t.double() if t.is_floating_point() else t for t in ts)

    inputs, targets = f64(inputs), f64((targets,))[0]
    refs = (f64(refs[0]), f64((refs[1],))[0])
    fn = resolve_loss(loss)
    with Engine(model, fn, exclude=exclude) as engine:
        names = [p.name for p in engine.plan.included]
        _, grads = naive_grads(model, inputs, targets, fn, names)
        _, ref_grads = naive_grads(model, *refs, fn, names)
    flat = torch.cat([grads[n].reshape(len(grads[n]), -1) for n in names], 1)  # (B, P)
    ref = torch.cat(
        [
            (ref_grads[n] / (denominators or {}).get(n, 1)).reshape(len(ref_grads[n]), -1)
            for n in names
        ],
        1,
    )  # (N, P)
    ref = ref if per_ref else ref.mean(0, keepdim=True)  # (K, P)
    return flat @ ref.T, flat.norm(dim=1), ref.norm(dim=1)


@dataclass
class ModelState:
    """What every engine path must leave of a model as it found it."""

    params: list[tuple[str, nn.Parameter, bool, Tensor]]  # name, object, requires_grad, value
    buffers: dict[str, Tensor]
    modes: list[bool]

    def assert_kept(self, model: nn.Module) -> None:
        """The same Parameter objects under every name (each path of a module registered at
        two), the same ``requires_grad``, values, buffers and modes, and no ``.grad``."""
        now = model_state(model)
        assert [(n, id(p), r) for n, p, r, _ in now.params] == [
            (n, id(p), r) for n, p, r, _ in self.params
        ], "a parameter was replaced, or its requires_grad changed"
        assert all(isinstance(p, nn.Parameter) for _, p, _, _ in now.params)
        assert all(torch.equal(a[3], b[3]) for a, b in zip(self.params, now.params, strict=True))
        assert now.buffers.keys() == self.buffers.keys()
        assert all(torch.equal(now.buffers[k], b) for k, b in self.buffers.items())
        assert now.modes == self.modes
        assert all(p.grad is None for _, p, _, _ in now.params)


def model_state(model: nn.Module) -> ModelState:
    named = model.named_parameters(remove_duplicate=False)
    return ModelState(
        [(name, p, p.requires_grad, p.detach().clone()) for name, p in named],
        {name: b.clone() for name, b in model.named_buffers()},
        [m.training for m in model.modules()],
    )
