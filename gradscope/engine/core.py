"""The passes: one forward and one backward that stops at layer outputs, then the rules' math."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..errors import GradscopeError, ModelError, one_line
from ..losses import LossFn
from ..rules import Contribution, find_rule
from .fallback import Fallback
from .forward import Forward
from .plan import FALLBACK, FALLBACK_LOOP, Plan, build_plan
from .session import HookSession

# What the probe for calls shared by examples found, per model and per (input shapes, hooked
# modules): per_example_norms builds a new Engine on every call, and the probe is one more
# backward, as costly as the main one (W1 of the benchmark: 1.62x the floor with it, 0.77x without).
_PROBED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, weakref.WeakSet[nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class BatchScores:
    """What one pass gives for a batch of B examples."""

    loss: Tensor  # (B,) each example's own loss
    norm_sq: dict[str, Tensor]  # parameter name -> (B,) squared norm of its per-example gradient
    inner: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, K) <G_i, refs[name][k]>
    observed: dict[str, Tensor] = field(default_factory=dict)  # what ``observe`` read, (B,) each


# (selected output, targets) -> {column: (B,) tensor}: read from the scoring forward, no extra pass
Observe = Callable[[Tensor, Tensor], dict[str, Tensor]]


def total(per_param: dict[str, Tensor]) -> Tensor:
    """The sum over parameters of per-parameter, per-example quantities, in float64."""
    return torch.stack([v.double() for v in per_param.values()]).sum(0)


@contextlib.contextmanager
def prepared(model: nn.Module, plan: Plan) -> Iterator[None]:
    """Eval mode and ``requires_grad`` on the selected parameters, restored on exit."""
    training = {m: m.training for m in model.modules()}
    requires = {id(p.param): (p.param, p.param.requires_grad) for p in plan.params}
    model.eval()
    try:
        for p in plan.included:
            p.param.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for m, mode in training.items():
            m.train(mode)
        for p, flag in requires.values():
            p.requires_grad_(flag)


class Engine:
    """Per-example gradient quantities of ``model`` under ``loss_fn``: the one entry point.

    Builds the plan for the parameters ``include``/``exclude`` select; ``forward`` says how the
    model is called and which output the loss reads; ``observe`` reads more per-example columns
    from the same output. Use it as a context manager around scoring: ``with engine:`` puts the
    model in eval mode with the selected parameters requiring grad, and restores both on exit.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        forward: Forward | None = None,
        observe: Observe | None = None,
    ):
        self.model, self.loss_fn = model, loss_fn
        self.plan = build_plan(model, include, exclude)
        self.forward = forward or Forward()
        self.observe = observe
        self._copy: set[int] = set()  # modules whose outputs the model later edits in place
        self._probed = False  # whether a batch of B > 1 was probed for calls shared by examples
        self._prepared: list[contextlib.ExitStack] = []
        self.fallback = Fallback(model, loss_fn, self.forward)

    def __enter__(self) -> Engine:
        stack = contextlib.ExitStack()
        stack.enter_context(prepared(self.model, self.plan))
        self._prepared.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._prepared.pop().close()

    def losses(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """(B,) per-example losses, with the graph kept for the backward."""
        losses, _ = self._losses(inputs, targets)
        return losses

    def _losses(
        self, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(B,) losses and what ``observe`` reads from the same output."""
        try:
            output = self.forward(self.model, inputs)
        except GradscopeError:
            raise
        except Exception as e:  # whatever the user's forward raises: one line naming it
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            raise ModelError(
                f"the model cannot take inputs of shape {shapes}: {type(self.model).__name__}'s "
                f"forward raised {type(e).__name__}: {one_line(e)}",
                "data.inputs",
            ) from e
        observed = {}
        if self.observe is not None:
            with torch.no_grad():
                observed = self.observe(output.detach(), targets)
        return self.loss_fn(output, targets), observed

    def contributions(
        self, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Contribution | None]]:
        """Per-example losses and each included parameter's per-example gradient.

        Rule-served parameters come factored from the hooked calls; the rest, and any whose
        module never ran although the parameter reached the loss, from the fallback.
        """
        while True:
            # with every parameter on the fallback, this pass only gives the losses: no graph
            with (
                torch.set_grad_enabled(bool(self.plan.by_rule)),
                HookSession(self.plan.hooked_modules, self._copy) as session,
            ):
                losses, observed = self._losses(inputs, targets)
            edited = session.edited_in_place() - self._copy
            if not edited:
                break
            self._copy |= edited  # capture copies from now on, and redo this batch
        batch = losses.shape[0]
        hooked = self.plan.hooked_modules
        known = _PROBED.setdefault(self.model, {})
        key = (tuple(tuple(t.shape) for t in inputs), frozenset(id(m) for m in hooked))
        probe = None
        if self.plan.by_rule and not self._probed and batch > 1 and key not in known:
            self._probed = True  # once: later batches only check the leading dimension
            probe = losses[-1]
        shared = session.not_per_example(batch, probe)
        if probe is not None:
            known[key] = weakref.WeakSet(m for m in hooked if id(m) in shared)
        shared |= {id(m) for m in known.get(key, ())}  # what an earlier Engine's probe found
        for p in self.plan.by_rule:
            if any(id(m) in shared for m, _ in p.owners):
                p.rule = FALLBACK
                p.note = "rows of its module's output are not the examples"
        uncalled = [
            p for p in self.plan.by_rule if not any(session.calls[id(m)] for m, _ in p.owners)
        ]
        if self.plan.by_rule:
            reached = session.backward(losses.sum(), [p.param for p in uncalled])
            for p, g in zip(uncalled, reached, strict=True):
                if g is not None:  # used without calling its module: no rule can see it
                    p.rule = FALLBACK
                    p.note = "used without a call of its module"
            for p in self.plan.by_rule:
                if any(c.others_reach_loss for m, _ in p.owners for c in session.calls[id(m)]):
                    p.rule = FALLBACK  # the rule only follows the gradient of the first output
                    p.note = "a second output of its module (attention weights) reaches the loss"
        parts: dict[tuple[int, int], dict[str, Contribution]] = {}
        result: dict[str, Contribution | None] = {}
        for p in self.plan.by_rule:
            total = None
            for module, attr in p.owners:
                rule = find_rule(module)
                for n, call in enumerate(session.calls[id(module)]):
                    if call.grad is None:
                        continue  # this call does not reach the loss
                    key = (id(module), n)
                    if key not in parts:
                        parts[key] = rule.fn(module, call.inputs, call.grad, **call.kwargs)
                    part = parts[key][attr]
                    total = part if total is None else total.merge(part)
            result[p.name] = total
        fallback = self.plan.fallback
        result.update(self.fallback.grads([p.name for p in fallback], inputs, targets))
        if self.fallback.vmap_error:
            for p in (p for p in fallback if p.rule != FALLBACK_LOOP):
                p.rule = FALLBACK_LOOP
                p.note += f"; vmap failed: {self.fallback.vmap_error}"
        self._observed = observed
        return losses.detach(), result

    def norms(
        self, inputs: tuple[Tensor, ...], targets: Tensor, refs: dict[str, Tensor] | None = None
    ) -> BatchScores:
        """Losses and squared norms; with ``refs`` ({name: (K, *shape)}) also the inner products
        of each example's gradient with them, from the same contributions (one forward+backward)."""
        losses, contributions = self.contributions(inputs, targets)
        zeros = losses.new_zeros(losses.shape[0])
        norm_sq = {name: zeros if c is None else c.norm_sq() for name, c in contributions.items()}
        inner: dict[str, Tensor] = {}
        if refs is not None:
            for name, c in contributions.items():
                k = refs[name].shape[0]
                inner[name] = (
                    losses.new_zeros(losses.shape[0], k) if c is None else c.inner(refs[name])
                )
        return BatchScores(loss=losses, norm_sq=norm_sq, inner=inner, observed=self._observed)
