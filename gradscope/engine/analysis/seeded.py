"""The analysis of one region call in a replayed batch (``replay/session.py``): the trace and the
tap over the region's forward only, seeded with the owners the analysed batch found at its
start, and the calls of hooked modules inside it captured as the analysis captures them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..capture import Call
from ..plan import BROADCAST, ParamPlan, Plan
from ..record import Findings
from .decide import layout_of
from .owners import padded_rows
from .session import HookSession
from .tap import ParamTap, Use
from .trace import IRREGULAR, RowTrace


class Seeded:
    """One region call: ``tensors`` its tensor arguments, ``entry`` their owner specs (None: no
    example's; (dim, m): the batch along a dimension). Its trace and tap are pushed at once, and
    ``finish`` (or ``close``) pops them. ``outside(module)`` says whether a call of a module
    whose rule serves its parameters is under way outside the region; ``root``: the region is the
    model's own call, whose outputs end padded or as the batch (``finder.py``'s ``_padded``)."""

    def __init__(
        self,
        plan: Plan,
        findings: Findings,
        copy: set[int],
        batch: int,
        tensors: Sequence[Tensor],
        entry: tuple,
        outside: Callable[[nn.Module], bool],
        root: bool = False,
    ):
        self.plan, self.batch, self.root = plan, batch, root
        device = tensors[0].device if tensors else None
        self.trace = RowTrace(batch, (), device)
        self.seed(tensors, entry)
        expand, assume = findings.expand is not False, findings.assume
        self.session = HookSession(plan.hooked_modules, self.trace, copy, expand, assume)

        def ruled(p: ParamPlan) -> bool:
            inside = any(self.session.inside(m) or outside(m) for m, _ in p.owners)
            return p.rule != BROADCAST and inside

        watched = plan.by_rule + plan.raw
        self.tap = ParamTap(watched, batch, self.trace, ruled, expand, assume)
        self._open = [self.trace, self.tap]
        for mode in self._open:
            mode.__enter__()
        self._paused = False

    def seed(self, tensors: Sequence[Tensor], specs: tuple) -> None:
        """``tensors`` owned as ``specs`` say (the analysed batch's owners)."""
        for t, spec in zip(tensors, specs, strict=True):
            if spec is not None:
                dim, m = spec
                self.trace.owners[t] = self.trace.lane_owners(t.dim(), (dim, m), t.shape[dim])

    # -- a child of the region (``analysis/children.py``): its forward without them ------------

    def pause(self) -> bool:
        """Take the trace and the tap off the torch function modes while a child runs; False
        where they are not the innermost modes (the model pushed one of its own)."""
        n = torch._C._len_torch_function_stack()
        top = [torch._C._get_function_stack_at(k) for k in range(max(0, n - 2), n)]
        if self._paused or len(top) != 2 or top[0] is not self.trace or top[1] is not self.tap:
            return False
        for _ in self._open:
            torch._C._pop_torch_function_stack()
        self._paused = True
        return True

    def resume(self) -> None:
        """The trace and the tap back on, as the child's end is reached."""
        if self._paused:
            for mode in self._open:
                torch._C._push_on_torch_function_stack(mode)
            self._paused = False

    # -- the region's hooked calls, handed on by the replay's hooks -------------------------

    def enter(self, module: nn.Module, args: tuple) -> tuple | None:
        return self.session._enter(module, args)

    def captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        self.session._captured(module, args, kwargs, output)

    # -- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """Pop the trace and the tap (innermost first); off the stack already where paused."""
        while self._open:
            mode = self._open.pop()
            if not self._paused:
                mode.__exit__(None, None, None)

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        """The region's end: its modes popped; why the batch is not one the analysis describes
        (outputs owned otherwise than analysed, rows no rule can read, a parameter read in a
        way that would move it to the fallback), or None."""
        self.close()
        if len(outputs) != len(exit):
            return "other outputs than the analysed batch's"
        with torch._C.DisableTorchFunction():
            for t, spec in zip(outputs, exit, strict=True):
                if not self.owned(t, spec):
                    return "outputs owned otherwise than the analysed batch's"
            for p in self.plan.by_rule + self.plan.raw:
                other = self.tap.uses[p.name].other
                if other:
                    return f"{p.name} read by {other}"
            for call in self.session.all_calls():
                reason = layout_of(call, self.trace)
                if reason:
                    return f"a call of {type(call.module).__name__}: {reason}"
        return None

    def owned(self, t: Tensor, spec: tuple | None) -> bool:
        found = self.trace.spec(t)
        if found in (IRREGULAR, None) and self.root and spec is not None and tuple(spec) == (0, 1):
            return padded_rows(self.trace.owner(t), self.batch)  # padded (or all): as analysed
        return found == (None if spec is None else tuple(spec))

    def calls(self) -> list[Call]:
        return self.session.all_calls()

    def pending(self) -> Tensor | None:
        return None

    def reads(self) -> list[Use]:
        return self.tap.reads()

    def reading(self, on_grad) -> None:
        self.tap.reading(on_grad)
