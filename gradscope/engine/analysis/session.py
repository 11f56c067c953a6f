"""The analysis's module capture: every call of the hooked modules during one traced forward,
each with its inputs' owners (``trace.py``), its shared rows expanded to the batch or its rows
assumed to be the examples' where the rows policy (``policy.py``) says so; and, in order, what
happened at each call, for the replay program (``replay/session.py``) to repeat."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...rules import find_rule
from ...rules.registry import read_by_bags
from ..capture import Call, Capture, counter, first_output, leading, shapes_of, spread
from ..hooks import ModuleHooks
from .policy import assumable, batch_free, shared
from .trace import RowTrace


@dataclass(eq=False)
class Entered:
    """One call as the forward pre-hook saw it, and what became of it."""

    module: nn.Module
    shapes: tuple  # (shape, dtype) of its tensor arguments: what a later batch must show again
    handed: bool  # left to the tap (batch-free: computed from parameters alone)
    expand: bool  # its shared leading rows expanded to the batch
    call: Call | None = None  # its capture; None where no gradient flows back through it
    bags: bool = False  # its rule reads it by bags (``read_by_bags``), decided as it ends


class HookSession(Capture):
    """Records every call of ``modules`` during one traced forward of a batch.

    Modules in ``copy`` get their captured inputs copied, for models that edit a layer's input in
    place after the layer has read it. ``expand`` and ``assume`` turn the rows policy's
    expansion and assumption on (the engine turns each off for a batch where its check fails).
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        trace: RowTrace,
        copy: set[int] | None = None,
        expand: bool = False,
        assume: bool = False,
        hooks: ModuleHooks | None = None,
    ):
        super().__init__(modules, hooks)
        self.trace = trace
        self.copy = copy if copy is not None else set()
        self.expand, self.assume = expand, assume
        self.assumed = False  # a call was taken to have one row per example
        self.events: list[Entered] = []  # every call, in the order it began
        self.active: dict[int, list[Entered]] = {}  # module id -> its calls under way
        self.log: list[tuple[str, object, int]] | None = None  # the regions' finder's

    @property
    def expanded(self) -> bool:
        return any(c.expanded for cs in self.calls.values() for c in cs)

    def inside(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` that its rule serves is under way: reads of its
        parameters are the rule's."""
        return any(not e.handed for e in self.active.get(id(module), ()))

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None:
        """The forward pre-hook: the call is under way; its shared leading rows expanded, or
        the call left to the tap where its tensors are batch-free."""
        at = counter()
        with torch._C.DisableTorchFunction():  # shapes and owners: none of the model's ops
            x = args[0] if args else None
            rule = find_rule(module)
            expand = bool(
                self.expand
                and rule is not None
                and rule.batch_dim is None
                and not (rule.bags is not None and getattr(x, "ndim", 0) == 1)  # flat ids
                and shared(self.trace, x)
            )
            assumed = self.assume and getattr(x, "shape", ())[:1] == (self.trace.batch,)
            tensors = [a for a in spread(args) if isinstance(a, Tensor)]  # a packed one's too
            handed = not expand and not assumed and bool(tensors)
            handed = handed and batch_free(self.trace, tensors)
        event = Entered(module, shapes_of(args), handed, expand)
        self.events.append(event)
        if self.log is not None:
            self.log.append(("pre", event, at))
        self.active.setdefault(id(module), []).append(event)
        if not expand:
            return None
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        return (rows.expand(self.trace.batch, *rows.shape[1:]), *args[1:])

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """The forward hook: the call recorded, with no function mode watching its own ops."""
        event = self.active[id(module)].pop()
        if self.log is not None:
            self.log.append(("post", event, counter()))
        if event.handed:
            return
        with torch._C.DisableTorchFunction():
            out, _ = first_output(output)
            tensors = spread(args)  # a packed sequence's too
            lead = tensors[: leading(tensors)]
            event.bags = read_by_bags(module, lead, kwargs)
            owners = tuple(self.trace.owner(a) for a in lead)
            if isinstance(out, Tensor) and self._standard(event, tensors, owners, out):
                # row i is what example i reads: the trace checks where each output row goes
                owners = (self.trace.standard(tensors[0].dim()), *owners[1:])
                self.trace.owners[out] = self.trace.standard(out.dim())
            copy = id(module) in self.copy
            event.call = self.record(
                module, args, kwargs, output, copy, owners=owners, expanded=event.expand
            )

    def _standard(self, event: Entered, args: tuple, owners: tuple, out: Tensor) -> bool:
        """Whether the call's leading rows are taken as the examples': expanded, or assumed
        (the losses' owners later tell whether that held; if not, the engine runs the batch
        again without assuming)."""
        if event.expand:
            return True
        if not self.assume or not owners or out.shape[:1] != args[0].shape[:1]:
            return False
        if not assumable(self.trace, args[0], owners[0]):
            return False
        self.assumed = True
        return True
