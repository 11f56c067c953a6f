"""The hook session: captures each call's inputs, arguments and output of the hooked modules, then
the gradient of the summed loss with respect to each output. All state lives here; hooks are always
removed on exit, even after an exception."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..rules import find_rule


@dataclass
class Call:
    """One forward call of a module: its inputs and the gradient at its (first) output."""

    inputs: tuple[Tensor, ...]  # the leading positional tensors
    output: Tensor
    versions: tuple[int, ...]  # of inputs and output when captured: later in-place edits show up
    kwargs: dict[str, object] = field(default_factory=dict)  # every other argument, by name
    batch_dim: int | None = 0  # the output's dimension of examples; None: the call is unbatched
    others: tuple[Tensor, ...] = ()  # further outputs that carry gradient (attention weights)
    grad: Tensor | None = None
    others_reach_loss: bool = False  # a further output reached the loss: no rule sees that path


@functools.cache
def _positional_names(cls: type[nn.Module]) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional parameters, after ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in kinds)


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
            self._handles.append(module.register_forward_hook(self._capture, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _capture(
        self, module: nn.Module, args: tuple, kwargs: dict[str, object], output: object
    ) -> object:
        # a module returning (output, extras) (MultiheadAttention's attention weights): the rule
        # sees the first; the extras are watched for a path to the loss
        rest: tuple = ()
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            output, rest = output[0], output[1:]
        if not isinstance(output, Tensor) or not output.requires_grad:
            return None  # nothing flows back through this call
        copy = id(module) in self.copy
        # one detached tensor per distinct argument, so `query is key` still holds for the rule
        detached: dict[int, Tensor] = {}

        def keep(t: Tensor) -> Tensor:
            if id(t) not in detached:
                detached[id(t)] = t.detach().clone() if copy else t.detach()
            return detached[id(t)]

        n = next((i for i, a in enumerate(args) if not isinstance(a, Tensor)), len(args))
        inputs = tuple(keep(a) for a in args[:n])
        # positional arguments after the leading tensors, named as the forward names them
        names = _positional_names(type(module))[n:]
        named = {**dict(zip(names, args[n:], strict=False)), **kwargs}
        named = {k: keep(v) if isinstance(v, Tensor) else v for k, v in named.items()}
        replacement = None
        if copy:
            replacement = output.clone()  # downstream edits the clone; ours stays intact
        rule = find_rule(module)
        call = Call(
            inputs,
            output,
            tuple(t._version for t in (*inputs, output)),
            kwargs=named,
            batch_dim=rule.batch_dim(module, inputs) if rule and rule.batch_dim else 0,
            others=tuple(t for t in rest if isinstance(t, Tensor) and t.requires_grad),
        )
        self.calls[id(module)].append(call)
        if replacement is not None and rest:
            return (replacement, *rest)
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
            if call.batch_dim is None
            or call.output.dim() <= call.batch_dim
            or call.output.shape[call.batch_dim] != batch
        }
        keyed = [(key, c) for key, calls in self.calls.items() if key not in shared for c in calls]
        if probe is None or not keyed:  # nothing left for the probe to ask about
            return shared
        grads = torch.autograd.grad(
            probe, [c.output for _, c in keyed], allow_unused=True, retain_graph=True
        )
        for (key, call), grad in zip(keyed, grads, strict=True):
            others = None if grad is None else grad.movedim(call.batch_dim, 0)[:-1]
            if others is not None and ((others != 0) & others.isfinite()).any():
                shared.add(key)
        return shared

    def backward(self, total: Tensor, also: Sequence[Tensor] = ()) -> list[Tensor | None]:
        """Fill each call's ``grad`` with d total / d output; return d total / d ``also``.

        No other parameter gradient is computed; ``None`` for a tensor of ``also`` that does not
        reach ``total``.
        """
        calls = [c for cs in self.calls.values() for c in cs]
        others = [(c, t) for c in calls for t in c.others]
        if not calls and not also:
            return []
        grads = torch.autograd.grad(
            total, [*(c.output for c in calls), *(t for _, t in others), *also], allow_unused=True
        )
        for call, grad in zip(calls, grads, strict=False):
            call.grad = grad
        for (call, _), grad in zip(others, grads[len(calls) :], strict=False):
            call.others_reach_loss |= grad is not None
        return list(grads[len(calls) + len(others) :])
