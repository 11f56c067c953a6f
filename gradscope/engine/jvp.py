"""Forward-mode influence: every example's <grad l_i, r> as one JVP of the per-example losses."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..losses import LossFn
from .backward.substitute import substituted
from .engine import Engine
from .tangents import Tangents


class JvpUnsupported(Exception):
    """The model or loss runs an op without a forward-mode derivative (or one torch.func refuses)."""


@contextmanager
def composite_attention() -> Iterator[None]:
    """Attention on composite ops, each with a forward-mode rule: nn.MultiheadAttention and
    nn.TransformerEncoderLayer off their fused inference kernels, scaled-dot-product attention
    on its math backend instead of the flash/memory-efficient kernels."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def loss_tangent(
    loss_fn: LossFn, z: Tensor, dz: Tensor | None, targets: Tensor
) -> tuple[Tensor, Tensor]:
    """(B,) losses of outputs ``z`` and their tangents along ``dz``: sum_j dl_i/dz_j dz_j, the
    derivative read off the loss's own backward (the loss alone: a small one). Forward mode
    through the loss cancels to 0 where a fitted classifier's softmax has saturated (p - 1 of
    nearly equal numbers), where the backward's gradient keeps the small probabilities."""
    with torch.enable_grad():
        zg = z.detach().requires_grad_(True)
        losses = loss_fn(zg, targets)
        (g,) = torch.autograd.grad(losses.sum(), zg, allow_unused=True)
    if g is None or dz is None:  # the output does not move along this direction
        return losses.detach(), torch.zeros_like(losses.detach())
    return losses.detach(), (g * dz).reshape(len(losses), -1).sum(1)  # (B,)


def jvp_inner(
    engine: Engine,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    tangents: dict[str, Tensor],
    composite: bool = False,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(B,) losses, (B, K) directional derivatives d/de l_i(theta + e r_k), r_k = tangents[.][k],
    and what the engine's ``observe`` reads from the output.

    ``tangents`` holds (K, *shape) per selected parameter; each direction is one forward pass with
    dual numbers and no backward. The losses and observed columns come from the first pass.
    ``composite`` is for models whose fused kernels have no forward-mode rule: attention then
    runs on composite ops (``composite_attention``).

    No autograd graph is recorded: each activation and its tangent are freed as soon as the
    next layer has read them, so the peak is a few layers' values, not the whole forward's.
    """
    names = [p.name for p in engine.plan.included]
    hooked = [p.name for p in engine.plan.included if p.param._backward_hooks]
    if hooked:
        raise JvpUnsupported(f"{hooked[0]} has a hook on its gradient, which no forward pass runs")
    primals = [p.param.detach() for p in engine.plan.included]
    k = next(iter(tangents.values())).shape[0]
    primal, columns, observed = None, [], {}
    try:
        # forward_ad's dual tensors, not torch.func.jvp: its functorch wrapping cost 1.7x a plain
        # forward+backward on the digits MLP where dual tensors cost 1.05x
        attention = composite_attention() if composite else nullcontext()
        with torch.no_grad(), attention, fwAD.dual_level() as level:
            for j in range(k):
                duals = {  # torch's make_dual less fwAD's checks: a parameter's costs 4 us, not 15
                    n: torch._make_dual(v, tangents[n][j].to(v.dtype), level=level)
                    for n, v in zip(names, primals, strict=True)
                }
                args, kwargs = engine.forward.split(inputs)
                # the model alone under the rules: the duals made and the loss read without
                with substituted(engine.model, duals), Tangents(level):
                    output = engine.forward.select(engine.model(*args, **kwargs))
                z, dz = fwAD.unpack_dual(output)
                losses, tangent = loss_tangent(engine.loss_fn, z, dz, targets)
                if primal is None:
                    primal = losses
                    if engine.observe is not None:
                        observed = engine.observe(z, targets)
                output = duals = z = dz = None  # the next direction's pass starts with nothing held
                columns.append(tangent)
    except (RuntimeError, NotImplementedError) as e:
        raise JvpUnsupported(str(e).splitlines()[0]) from e
    return primal, torch.stack(columns, 1), observed  # (B, K)
