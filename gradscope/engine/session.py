"""The hook session: captures each call's inputs, arguments and output of the hooked modules in the
forward, then hands each call's output gradient to a callback as it arrives in the one backward.
All state lives here; hooks are always removed on exit, even after an exception."""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from ..rules import find_rule
from .graph import below_targets, read_at
from .owners import NONE, rows_or_none
from .trace import RowTrace


class Read(Protocol):
    """A read the tap serves (``tap.Use``): where its gradient arrives, and whether the backward
    requests it there (nothing below needs it)."""

    edge: GradientEdge
    requested: bool


@dataclass(eq=False)
class Call:
    """One forward call of a module: its inputs, arguments and where its (first) output's gradient
    arrives. The output itself is not kept: the model may free it, and edit it in place, freely
    (a hook or edge taken before an in-place edit still sees the gradient of the unedited value)."""

    module: nn.Module
    inputs: tuple[Tensor, ...]  # the leading positional tensors
    edge: GradientEdge  # of the output (or its base): the step of the backward that receives it
    shape: torch.Size  # of the output
    versions: tuple[int, ...]  # of the inputs when captured: later in-place edits show up
    kwargs: dict[str, object] = field(default_factory=dict)  # every other argument, by name
    owners: tuple[Tensor, ...] = ()  # of the inputs: which example each element is (trace.py)
    others: tuple[GradientEdge, ...] = ()  # further outputs with gradient (attention weights)
    expanded: bool = False  # its leading input was shared by the batch and expanded to it
    rows: Tensor | None = None  # a row-by-row call's example per row, where not one row each
    reached: bool = False  # its output's gradient arrived in the backward
    others_reach_loss: bool = False  # a further output reached the loss: no rule sees that path
    viewed: Callable[[Tensor], Tensor] | None = None  # the output's gradient from its base's

    def release(self) -> None:
        """Drop the captured tensors once the rule has read them."""
        self.inputs, self.kwargs, self.owners, self.rows = (), {}, (), None


@functools.cache
def _positional_names(cls: type[nn.Module]) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional parameters, after ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in kinds)


def _shared_leading(module: nn.Module, x: object, trace: RowTrace) -> bool:
    """Whether a call's leading tensor is one set of rows shared by the whole batch, for a rule
    that reads examples on dimension 0: a (1, ...) tensor or 1-D indices (``wpe(arange(T))``)
    computed from no example (its owners, read last: the shapes rule out most calls)."""
    rule = find_rule(module)
    if rule is None or rule.batch_dim is not None or not isinstance(x, Tensor):
        return False
    if x.dim() == 1:
        shaped = not (x.is_floating_point() or x.is_complex())
    else:
        shaped = x.dim() > 1 and x.shape[0] == 1
    return shaped and bool((trace.owner(x) == NONE).all())


class HookSession:
    """Context manager that records every call of ``modules`` during one forward pass.

    Modules in ``copy`` get their captured inputs copied, for models that edit a layer's input in
    place after the layer has read it. With
    ``expand``, a call whose leading input holds rows shared by the batch
    (a position table looked up once, ``position_ids`` of shape (1, T)) gets that input expanded
    to the batch, so that each example has its own output rows and a rule can serve the call; the
    values every example sees are unchanged.
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        trace: RowTrace,
        copy: set[int] | None = None,
        expand: bool = False,
        assume: bool = False,
    ):
        self.modules = list(modules)
        self.trace = trace
        self.copy = copy if copy is not None else set()
        self.expand_to = trace.batch if expand else 0
        self.assume = assume
        self.assumed = False  # a call was taken to have one row per example (see _capture)
        self.calls: dict[int, list[Call]] = {id(m): [] for m in self.modules}
        self.active: dict[int, int] = {}  # module id -> its calls under way (the tap asks)
        self._expanding: set[int] = set()  # modules whose current call had its input expanded
        self._handed: dict[int, int] = {}  # module id -> its calls under way left to the tap
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._grad_hooks: list[torch.utils.hooks.RemovableHandle] = []  # live until the backward
        self._on_grad: Callable[[Call, Tensor], Tensor | None] | None = None

    def __enter__(self) -> HookSession:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._captured, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def expanded(self) -> bool:
        return any(c.expanded for cs in self.calls.values() for c in cs)

    def inside(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` is under way: reads of its parameters are its rule's."""
        return self.active.get(id(module), 0) > 0

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None:
        """The forward pre-hook: the call is under way; its shared leading rows expanded. A call
        on tensors no example owns (T5's relative-position table looked up by buckets of
        ``arange``) is left to the tap, which follows its result as computed from parameters."""
        with torch._C.DisableTorchFunction():  # shapes and owners: none of the model's ops
            expand = (
                self.expand_to
                and args
                and isinstance(args[0], Tensor)
                and _shared_leading(module, args[0], self.trace)
            )
            batch = (self.trace.batch,)
            assumed = self.assume and args and getattr(args[0], "shape", ())[:1] == batch
            handed = not expand and not assumed and self._batch_free(args)
        if handed:
            self._handed[id(module)] = self._handed.get(id(module), 0) + 1
            return None
        self.active[id(module)] = self.active.get(id(module), 0) + 1
        if not expand:
            return None
        x = args[0]
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        self._expanding.add(id(module))
        return (rows.expand(self.expand_to, *rows.shape[1:]), *args[1:])

    def _batch_free(self, args: tuple) -> bool:
        """Whether a call's tensors hold values and none of an example's (an empty input may be
        the rows routed to an expert: it is no example's on this batch only)."""
        tensors = [a for a in args if isinstance(a, Tensor)]
        for t in tensors:
            o = self.trace.owners.get(t)
            if (
                t.numel() == 0
                or o is not None
                and (self.trace.is_standard(o) or not bool((o == NONE).all()))
            ):
                return False
        return bool(tensors)

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """The forward hook: ``_capture`` with no function mode watching its own ops."""
        if self._handed.get(id(module), 0):
            self._handed[id(module)] -= 1
            return
        self.active[id(module)] -= 1
        with torch._C.DisableTorchFunction():
            self._capture(module, args, kwargs, output)

    def _capture(
        self, module: nn.Module, args: tuple, kwargs: dict[str, object], output: object
    ) -> None:
        expanded = id(module) in self._expanding
        self._expanding.discard(id(module))
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
        owners = tuple(self.trace.owner(a) for a in args[:n])
        if expanded or self._assumed(args[0], owners[0], output):
            # row i is what example i reads: the trace checks where each output row goes
            owners = (self.trace.standard(args[0].dim()), *owners[1:])
            self.trace.owners[output] = self.trace.standard(output.dim())
        # positional arguments after the leading tensors, named as the forward names them
        names = _positional_names(type(module))[n:]
        named = {**dict(zip(names, args[n:], strict=False)), **kwargs}
        named = {k: keep(v) if isinstance(v, Tensor) else v for k, v in named.items()}
        target, viewed = read_at(output, (*args, *kwargs.values()))
        call = Call(
            module,
            inputs,
            torch.autograd.graph.get_gradient_edge(target),
            output.shape,
            tuple(t._version for t in inputs),
            kwargs=named,
            owners=owners,
            others=tuple(
                torch.autograd.graph.get_gradient_edge(t)
                for t in rest
                if isinstance(t, Tensor) and t.requires_grad
            ),
            expanded=expanded,
            viewed=viewed,
        )
        self.calls[id(module)].append(call)
        self._grad_hooks.append(target.register_hook(functools.partial(self._read, call)))
        return None

    def _assumed(self, x: Tensor, owners: Tensor, output: Tensor) -> bool:
        """With ``assume``: a call on B rows computed, wholly or in part, from no example (a
        buffer of zeros expanded to the batch, ``token_type_ids``, a decoder's start token before
        each example's tokens) is taken to have row i read by example i alone; its output rows
        get example owners, and the losses' owners tell whether that held (if not, the engine
        runs the batch again without assuming)."""
        batch = self.trace.batch
        if (
            not self.assume
            or x.dim() == 0
            or x.shape[0] != batch
            or output.shape[:1] != x.shape[:1]
            or self.trace.is_standard(owners)  # every row an example's: none from no example
        ):
            return False
        if not bool((owners == NONE).any()) or not rows_or_none(owners, batch):
            return False
        self.assumed = True
        return True

    def _read(self, call: Call, grad: Tensor) -> Tensor | None:
        """The hook on each captured output: hands its gradient on during ``backward``."""
        return None if self._on_grad is None else self._on_grad(call, grad)

    def all_calls(self) -> list[Call]:
        return [c for cs in self.calls.values() for c in cs]

    def edited_in_place(self) -> set[int]:
        """Modules whose captured tensors were changed in place after capture."""
        return {
            id(call.module)
            for call in self.all_calls()
            if tuple(t._version for t in call.inputs) != call.versions
        }

    def backward(
        self,
        total: Tensor,
        calls: Sequence[Call],
        on_grad: Callable[[Call, Tensor], None],
        also: Sequence[Tensor] = (),
        reads: Sequence[Read] = (),
    ) -> list[Tensor | None]:
        """One backward of ``total`` that hands each call's output gradient to ``on_grad`` as it
        arrives, and returns d total / d ``also`` (``None`` where ``also`` does not reach it).

        Each gradient is read in a hook on the call's output and then left to autograd, which frees
        it once the layer below has used it: no call's gradient outlives its step of the backward.
        Autograd only runs the steps that lead to a requested tensor, so the calls with nothing to
        wait for below them (the first layer) are requested themselves; no parameter gradient is
        computed but those of ``also``. The tap's ``reads`` (whose own hooks hand their gradients
        on) are waited for the same way; those requested are marked so, for their hooks to keep
        no copy either.
        """
        nodes = [c.edge.node for c in calls]
        read_nodes = [r.edge.node for r in reads]
        leaves = [torch.autograd.graph.get_gradient_edge(t).node for t in also]
        below = below_targets([*nodes, *read_nodes], {*nodes, *read_nodes, *leaves})
        lowest = [c for c, node in zip(calls, nodes, strict=True) if not below[node]]
        lowest_reads = [r.edge for r in reads if not below[r.edge.node]]
        # an output two hooks read (a weight-norm Linear's: its weight the tap's, its bias the
        # rule's) keeps its gradient for both: neither may zero it for the other
        seen = Counter(_key(e.edge) for e in [*calls, *reads])
        both = {key for key, n in seen.items() if n > 1}
        for r in reads:
            r.requested = not below[r.edge.node] and _key(r.edge) not in both
        requested = {id(c) for c in lowest if _key(c.edge) not in both}
        wanted = {id(c) for c in calls}
        others = [t for c in calls for t in c.others]

        def read(call: Call, grad: Tensor | None) -> Tensor | None:
            # None: a base read for its view (graph.read_at) whose step ran for another output
            if id(call) not in wanted or grad is None:
                return None
            call.reached = True
            on_grad(call, grad if call.viewed is None else call.viewed(grad))
            # a requested call's gradient goes nowhere after this: keep no copy of it
            return grad.new_zeros(()).expand_as(grad) if id(call) in requested else None

        self._on_grad = read
        try:
            if not lowest and not others and not also and not lowest_reads:
                return []
            grads = torch.autograd.grad(
                total,
                [*(c.edge for c in lowest), *others, *also, *lowest_reads],
                allow_unused=True,
            )
        finally:
            self._on_grad = None
            for handle in self._grad_hooks:
                handle.remove()
            self._grad_hooks.clear()
        flags = iter(grads[len(lowest) : len(lowest) + len(others)])
        for call in calls:
            for _ in call.others:
                call.others_reach_loss |= next(flags) is not None
        start = len(lowest) + len(others)
        return list(grads[start : start + len(also)])


def _key(edge: GradientEdge) -> tuple[int, int]:
    return id(edge.node), edge.output_nr
