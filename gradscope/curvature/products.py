"""Exact curvature-vector products over the data, with ``torch.func``.

Over the selected parameters theta (one flat vector of P, in the plan's order) and N examples:

- the Gauss-Newton matrix (GGN) ``C = (1/N) sum_i J_i^T H_i J_i``, J_i the Jacobian of example
  i's model output w.r.t. theta, H_i the Hessian of its loss w.r.t. that output. ``C v`` per
  batch: ``J v`` by forward mode, ``H (J v)`` by forward mode through the gradient of the summed
  loss w.r.t. the output (the examples' losses are separate, so that Hessian is H_i per
  example), ``J^T (H J v)`` by one backward;
- the Hessian of the mean loss ``(1/N) sum_i d^2 l_i / d theta^2``: ``H v`` by forward mode
  through the gradient of the summed loss.

A block of directions is ``vmap``ped, as many at once as ``CHUNK_ELEMENTS`` holds: a direction
holds about the batch's activations (every module's outputs, counted in the batch's forward)
and a P-vector; where vmap cannot run the model, one direction at a time. Sums are kept in
float64 on the CPU. Each call is one pass over the batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_leaves

from ..engine import short_reason, substituted, total
from ..errors import ConfigError, DataError, ModelError, stop_if_signalled
from ..rules.base import CHUNK_ELEMENTS

GN, HESSIAN = "gn", "hessian"
MATH = [SDPBackend.MATH]
KINDS = (GN, HESSIAN)
Batches = Iterable[tuple[tuple[Tensor, ...], Tensor]]


class Flat:
    """The selected parameters as one vector of ``size``, in the engine's plan order."""

    def __init__(self, engine) -> None:
        self.names = [p.name for p in engine.plan.included]
        self.shapes = [p.param.shape for p in engine.plan.included]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.size = sum(self.sizes)

    def flatten(self, tensors: dict[str, Tensor]) -> Tensor:
        """{name: (K, *shape)} -> (K, P) float64 on the CPU."""
        return torch.cat(
            [tensors[n].detach().to("cpu", torch.float64).flatten(1) for n in self.names], 1
        )

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """(K, P) -> {name: (K, *shape)}."""
        parts = flat.split(self.sizes, dim=1)
        return {
            n: p.reshape(-1, *s) for n, p, s in zip(self.names, parts, self.shapes, strict=True)
        }


class Products:
    """``C V`` for a (P, K) block V, C the GGN (``gn``) or the Hessian of the mean loss
    (``hessian``) over ``batches()``; the engine must be entered (the model prepared)."""

    def __init__(self, engine, batches: Callable[[], Batches], kind: str = GN) -> None:
        if kind not in KINDS:
            raise ConfigError(f"exact curvature is gn or hessian, got {kind!r}", "--curvature")
        self.engine, self.batches, self.kind = engine, batches, kind
        self.flat = Flat(engine)
        params = dict(engine.model.named_parameters())
        self.theta = {n: params[n].detach() for n in self.flat.names}
        self.fixed = {n: p.detach() for n, p in params.items() if n not in self.theta}
        self.examples = 0  # N, known after the first pass
        self.passes = 0
        self.vmap_error: str | None = None
        # elements every module's outputs hold per example in a forward (None: not counted yet)
        self.per_example: float | None = None
        self.left_out = 0  # examples whose loss is not finite, out of C (``_finite``)
        self._kept: list[Tensor | None] = []  # each batch's finite rows (None: every one)

    def _output(self, theta: dict[str, Tensor], inputs: tuple[Tensor, ...]) -> Tensor:
        forward = self.engine.forward
        args, kwargs = forward.split(inputs)
        # attention by its composite math kernel: the fused ones have no forward-mode derivative
        with substituted(self.engine.model, {**self.fixed, **theta}), sdpa_kernel(MATH):
            return forward.select(self.engine.model(*args, **kwargs))

    def _pass(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Callable[[dict], dict]:
        """The batch's summed curvature times one direction ``v`` ({name: shape})."""
        loss_fn = self.engine.loss_fn

        def output(theta: dict[str, Tensor]) -> Tensor:
            return self._output(theta, inputs)

        def total(out: Tensor) -> Tensor:
            return loss_fn(out, targets).sum()

        if self.kind == HESSIAN:
            if self.per_example is None:  # the activations, the chunk's size: counted once
                with counted(self, targets.shape[0]), torch.no_grad():
                    output(self.theta)
            return lambda v: jvp(grad(lambda th: total(output(th))), (self.theta,), (v,))[1]
        with counted(self, targets.shape[0]):  # (B, ...): one forward, pulled back per direction
            out, pull = vjp(output, self.theta)
        out = out.detach()

        def one(v: dict[str, Tensor]) -> dict[str, Tensor]:
            jv = jvp(output, (self.theta,), (v,))[1]  # J_i v per example
            return pull(jvp(grad(total), (out,), (jv,))[1])[0]  # J_i^T H_i (J_i v)

        return one

    def _batch(self, v: dict[str, Tensor], inputs: tuple[Tensor, ...], targets: Tensor) -> dict:
        """{name: (K, *shape)}: the batch's summed curvature times each of K directions."""
        one = self._pass(inputs, targets)
        directions = next(iter(v.values())).shape[0]
        if self.vmap_error is None:
            # each vmapped direction holds about the batch's activations and a P-vector
            per = math.ceil(self.per_example * targets.shape[0]) + self.flat.size
            chunk = max(1, min(directions, CHUNK_ELEMENTS // per))
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*performance drop.*")
                    return vmap(one, chunk_size=chunk)(v)
            except Exception as e:  # the model ran eagerly on this batch: vmap's failure
                stop_if_signalled()
                self.vmap_error = short_reason(e)
        columns = [one({n: t[j] for n, t in v.items()}) for j in range(directions)]
        return {n: torch.stack([c[n] for c in columns]) for n in self.flat.names}

    def __call__(self, block: Tensor) -> Tensor:
        """(P, K) float64 -> (P, K) float64 on the CPU: C times each column, one data pass."""
        out = torch.zeros(block.shape[1], self.flat.size, dtype=torch.float64)  # (K, P)
        examples = 0
        for number, batch in enumerate(self.batches()):
            inputs, targets = self._finite(number, *batch)
            if not len(targets):
                continue
            like = next(iter(self.theta.values()))
            v = self.flat.unflatten(block.T.to(like.device, like.dtype))  # {name: (K, *shape)}
            try:
                out += self.flat.flatten(self._batch(v, inputs, targets))
            except (RuntimeError, NotImplementedError) as e:  # torch.func through the model
                stop_if_signalled()
                raise ModelError(
                    f"the exact curvature ({self.kind}) differentiates the model with torch.func, "
                    f"which cannot run it: {short_reason(e)}; --curvature kfac, ekfac or none "
                    "scores without it",
                    "--curvature",
                ) from e
            examples += targets.shape[0]
        if not examples:
            raise DataError("no examples: no curvature to fit", "data")
        if not torch.isfinite(out).all():
            raise DataError(
                "the curvature is not finite: an example's loss or gradient is NaN or infinite",
                "data",
            )
        self.examples, self.passes = examples, self.passes + 1
        return (out / examples).T

    def _finite(
        self, number: int, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        """Batch ``number`` without its examples whose loss or gradient is not finite (a NaN
        or inf in their inputs or target), which would make every entry of C NaN: left out and
        not counted, as the factors leave them out (``finite.py``), the scores' ``finite``
        false. Found on the first pass, by a norms pass of each batch."""
        if number == len(self._kept):
            scores = self.engine.norms(inputs, targets)
            finite = torch.isfinite(scores.loss) & torch.isfinite(total(scores.norm_sq))
            self._kept.append(None if bool(finite.all()) else finite)
            self.left_out += int((~finite).sum())
        keep = self._kept[number]
        if keep is None:
            return inputs, targets
        return tuple(t[keep] for t in inputs), targets[keep]

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "parameters": self.flat.size,
            "examples": self.examples,
            "left_out": self.left_out,
            "passes": self.passes,
            "vmap": self.vmap_error or "ok",
        }


@contextmanager
def counted(products: Products, batch: int):
    """Set ``products.per_example`` to the elements of every module's outputs in the forward
    run inside, over its ``batch`` examples."""
    elements = 0

    def count(module, args, output) -> None:
        nonlocal elements
        elements += sum(t.numel() for t in tree_leaves(output) if isinstance(t, Tensor))

    handle = register_module_forward_hook(count)
    try:
        yield
    finally:
        handle.remove()
    products.per_example = elements / max(batch, 1)
