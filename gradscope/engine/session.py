"""The hook session: captures each call's inputs and output of the hooked modules, then the
gradient of the summed loss with respect to each output. All state lives here; hooks are always
removed on exit, even after an exception."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class Call:
    """One forward call of a module: its tensor inputs and the gradient at its output."""

    inputs: tuple[Tensor, ...]
    output: Tensor
    versions: tuple[int, ...]  # of inputs and output when captured: later in-place edits show up
    grad: Tensor | None = None


class HookSession:
    """Context manager that records every call of ``modules`` during one forward pass.

    Modules in ``copy`` get their captured tensors copied and their output replaced by a clone, for
    models that later edit those tensors in place (``ReLU(inplace=True)`` after a layer).
    """

    def __init__(self, modules: Iterable[nn.Module], copy: set[int] | None = None):
        self.modules = list(modules)
        self.copy = copy if copy is not None else set()
        self.calls: dict[int, list[Call]] = {id(m): [] for m in self.modules}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> HookSession:
        for module in self.modules:
            self._handles.append(module.register_forward_hook(self._capture))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture(self, module: nn.Module, args: tuple, output: object) -> Tensor | None:
        if not isinstance(output, Tensor) or not output.requires_grad:
            return None  # nothing flows back through this call
        inputs = tuple(a.detach() for a in args if isinstance(a, Tensor))
        replacement = None
        if id(module) in self.copy:
            inputs = tuple(a.clone() for a in inputs)
            replacement = output.clone()  # downstream edits the clone; ours stays intact
        versions = tuple(t._version for t in (*inputs, output))
        self.calls[id(module)].append(Call(inputs, output, versions))
        return replacement

    def edited_in_place(self) -> set[int]:
        """Modules whose captured tensors were changed in place after capture."""
        return {
            key
            for key, calls in self.calls.items()
            for call in calls
            if tuple(t._version for t in (*call.inputs, call.output)) != call.versions
        }

    def not_per_example(self, batch: int, probe: Tensor | None = None) -> set[int]:
        """Modules with a call whose output rows are not the batch's examples.

        A rule reads row i of a call as example i. That fails for a call on a tensor shared by all
        examples (a positional table looked up with ``arange(T)`` and broadcast over the batch):
        its leading dimension is not ``batch``, or, when T happens to equal B, ``probe`` (one
        example's loss, graph retained) has a gradient in the rows of other examples. NaN rows
        say nothing: a non-finite example gives NaN there without any dependence.
        """
        shared = {
            key
            for key, calls in self.calls.items()
            for call in calls
            if call.output.dim() == 0 or call.output.shape[0] != batch
        }
        keyed = [(key, c) for key, calls in self.calls.items() if key not in shared for c in calls]
        if probe is None or not keyed:  # nothing left for the probe to ask about
            return shared
        grads = torch.autograd.grad(
            probe, [c.output for _, c in keyed], allow_unused=True, retain_graph=True
        )
        for (key, _), grad in zip(keyed, grads, strict=True):
            if grad is not None and ((grad[:-1] != 0) & grad[:-1].isfinite()).any():
                shared.add(key)
        return shared

    def backward(self, total: Tensor, also: Sequence[Tensor] = ()) -> list[Tensor | None]:
        """Fill each call's ``grad`` with d total / d output; return d total / d ``also``.

        No other parameter gradient is computed; ``None`` for a tensor of ``also`` that does not
        reach ``total``.
        """
        calls = [c for cs in self.calls.values() for c in cs]
        if not calls and not also:
            return []
        grads = torch.autograd.grad(total, [*(c.output for c in calls), *also], allow_unused=True)
        for call, grad in zip(calls, grads, strict=False):
            call.grad = grad
        return list(grads[len(calls) :])
