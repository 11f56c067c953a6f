"""The replayed pass: a later batch of an analysed signature repeats the analysis's outcome, with
module hooks alone (no owners, no function mode, no host sync) outside its regions, while a
witness shows that it is a batch the analysis describes.

The analysis (``analysis/``) of a batch ends in a ``Program``: what happened at each call of the
hooked modules (left to the tap, rows expanded to the batch, the layout of a row-by-row call's
rows), which outputs the backward requests, which parameters no call reached, and the regions
(``analysis/finder.py``): the module calls where something needs the trace and the tap on
every batch (a parameter read outside its module's calls, rows the batch's values pick, values
read on the host). A replayed batch runs each region under a fresh trace and tap, seeded with
the owners the analysis found at the region's start, and checks that its outputs' owners are
the analysed ones at its end; everything between regions replays as analysed.

The witness, checked as the batch runs: outside the regions the same calls of the same modules,
on arguments of the same shapes and dtypes, in the same order, with outputs of the same shapes,
and as many autograd nodes made between any two of these events (autograd's sequence counter:
a differentiable op added, dropped or moved shows); each region's outputs owned as analysed;
no captured input edited in place; the rows each region finds layouts for, no parameter read
in a way that would move it to the fallback; and no gradient at a parameter that no call or
read of the batch reached. A batch that breaks it is analysed in full (``Diverged``), and its
program joins the signature's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import Call, Capture, counter, first_output, shapes_of
from ..hooks import ModuleHooks
from ..plan import BROADCAST, ParamPlan, Plan
from ..steps import Diverged, Program, RegionCall, Step
from .intercept import Intercept
from .region import Region, RegionHooks
from .root import RootReads, in_order


class ReplaySession(RegionHooks, Capture):
    """Captures the calls of ``modules`` as ``program`` says, running its regions under
    ``region`` (``RegionCall``, tensor args -> the region's analysis, entered), checking the
    witness as it goes."""

    def __init__(
        self,
        modules: Iterable[nn.Module],
        regions: Iterable[nn.Module],
        program: Program,
        batch: int,
        copy: set[int],
        region: Callable[[RegionCall, list[Tensor]], Any] | None = None,
        plan: Plan | None = None,
        buffers: frozenset[int] = frozenset(),
        branched: Callable[[], None] = lambda: None,
        hooks: ModuleHooks | None = None,
        children: Iterable[nn.Module] = (),
        intercept: Intercept | None = None,
    ):
        super().__init__(modules, hooks)
        self.regions, self.children = list(regions), list(children)
        self.steps, self.batch, self.copy = program.steps, batch, copy
        self.program, self.make_region = program, region
        # the examples' own values of the branches the witnesses read (``owned.py``)
        self.owned: list | None = [] if program.branches else None
        self.next = 0
        self.active: dict[int, list[Step]] = {}
        self.region: Region | None = None
        self.done: list[Any] = []  # the regions' analyses, in the order they ran
        self.diverged: str | None = None
        self.plan, self.root = plan, None  # the reads outside every region (``RootReads``)
        self.buffers = buffers  # ids of the model's buffers (``LightRegion``)
        self.branched = branched  # told when values read on the host outside regions differ
        self.intercept = intercept  # the root's reads intercepted (``intercept.py``): told where
        # they fail; None: the root's mode sees them
        self._last = 0

    def __enter__(self) -> ReplaySession:
        super().__enter__()  # the hooked modules' hooks first, as the analysis's were
        try:
            for module in self.regions:
                pre = module.register_forward_pre_hook(self._region_enter, with_kwargs=True)
                self._handles += [pre, module.register_forward_hook(self._region_exit)]
            for module in self.children:
                pre = module.register_forward_pre_hook(self._child_enter, with_kwargs=True)
                self._handles += [pre, module.register_forward_hook(self._child_exit)]
            self._last = counter()
            if self.program.root or self.program.hosts:
                self.root = RootReads(
                    self.plan,
                    self.program,
                    self.batch,
                    self._ruled,
                    self.buffers,
                    self._outside,
                    self.branched,
                    self.intercept,
                    self.owned,
                )
        except BaseException:  # no with runs __exit__ then: give the hooks back here
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self.region is not None:  # the forward raised inside a region: leave its modes
            if self.region.child_light is not None:
                self.region.child_light.close()
            self.region.analysis.close()
            self.region = None
        if self.root is not None:
            self.root.close()

    def unlink(self) -> None:
        """The pass is over: drop what refers back to the session (its regions' analyses and
        root reads hold its methods, ``make_region`` it), or the cycles keep the batch's tensors
        until Python's collector runs, and a training loop's heap grows step by step."""
        self.done, self.root, self.make_region = [], None, None

    def _outside(self) -> bool:
        """Whether no region call is under way (its reads on the host are its own)."""
        return self.region is None

    def _ruled(self, p: ParamPlan) -> bool:
        """Whether ``p`` is read inside a call of the module whose rule serves it."""
        return p.rule != BROADCAST and any(self.inside(m) for m, _ in p.owners)

    def diverge(self, why: str) -> None:
        self.diverged = self.diverged or why
        if self.root is not None and self.root.missed():  # its witness would fail at the end
            self.intercept.failed()
        raise Diverged(self.diverged)

    # the backward hands each call's gradient on: the regions' calls' too

    @property
    def on_grad(self) -> Callable[[Call, Tensor], Tensor | None] | None:
        return self._on_grad

    @on_grad.setter
    def on_grad(self, on_grad: Callable[[Call, Tensor], Tensor | None] | None) -> None:
        self._on_grad = on_grad
        for region in getattr(self, "done", ()):
            region.session.on_grad = on_grad

    def release_hooks(self) -> None:
        super().release_hooks()
        for region in self.done:
            region.session.release_hooks()

    def _ticked(self, expected: int, where: str, module: nn.Module) -> None:
        """As many autograd nodes made since the previous event as the analysed batch made."""
        now = counter()
        made, self._last = now - self._last, now
        if made != expected:
            name = type(module).__name__
            self.diverge(f"other operations than the analysed batch's {where} {name}")

    def inside(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` that its rule serves is under way outside the regions:
        reads of its parameters inside a region are the rule's."""
        return any(not s.handed for s in self.active.get(id(module), ()))

    # -- the hooks ---------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None:
        """A hooked module's call begins: a step; inside a region, the region's own."""
        if self.diverged:  # the model caught our exception: stop at the next call
            raise Diverged(self.diverged)
        if self.region is not None and self.region.owns:
            return self.region.analysis.enter(module, args)
        self._spent()
        return self._step(module, args)

    def _spent(self) -> None:
        """Leave the root's mode once it has seen all it must (``RootReads.spent``)."""
        root = self.root
        if root is None or not root.running or not root.spent():
            return
        depth = torch._C._len_torch_function_stack()
        if root.intercepts or (depth and torch._C._get_function_stack_at(depth - 1) is root):
            root.close()

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        """A hooked module's call ends."""
        region = self.region
        own = region is not None and region.owns
        if own and (module is not region.module or region.depth > 1):
            region.analysis.captured(module, args, kwargs, output)
            return
        with torch._C.DisableTorchFunction():  # a region's modes may still be on
            self._capture(module, args, kwargs, output)

    def _step(self, module: nn.Module, args: tuple) -> tuple | None:
        step = self.steps[self.next] if self.next < len(self.steps) else None
        if not isinstance(step, Step) or step.module != id(module):
            self.diverge(f"another call than the analysed batch's: {type(module).__name__}")
        if step.shapes != shapes_of(args):
            self.diverge(f"a call of {type(module).__name__} on other shapes")
        self._ticked(step.before, "before a call of", module)
        self.next += 1
        self.active.setdefault(id(module), []).append(step)
        if not step.expand:
            return None
        x = args[0]
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        return (rows.expand(self.batch, *rows.shape[1:]), *args[1:])

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        step = self.active[id(module)].pop()
        if step.during is None:  # a region ran inside it
            self._last = counter()
        else:
            self._ticked(step.during, "in a call of", module)
        if step.handed:
            return
        out, _ = first_output(output)
        shape = tuple(out.shape) if isinstance(out, Tensor) and out.requires_grad else None
        if shape != step.output:
            self.diverge(f"a call of {type(module).__name__} with another output")
        if shape is not None:
            copy = id(module) in self.copy
            self.record(module, args, kwargs, output, copy, expanded=step.expand, rows=step.rows)

    def finish(self) -> None:
        """After the forward: every analysed call made, as many operations after the last as
        the analysed batch ran, no captured input edited since."""
        if self.diverged:
            raise Diverged(self.diverged)
        if self.next != len(self.steps):
            self.diverge("fewer calls than the analysed batch's")
        self._ticked(self.program.tail, "after the last call of", self)
        edited = self.edited_in_place() - self.copy
        if edited:
            self.diverge("a captured input was edited in place")
        if self.root is not None:
            why = self.root.finish_reads()
            if why:
                self.diverge(f"{why} outside the regions")
            self.done.append(self.root)
        flags = [f for r in self.done if (f := r.pending()) is not None]
        if flags and bool(torch.stack(flags).any()):  # the one host sync of routed regions
            self.diverge("rows that the batch's values put where the analysed batch's were not")

    def all_calls(self) -> list[Call]:
        """The calls captured outside the regions, then those inside each region."""
        return [*super().all_calls(), *(c for r in self.done for c in r.calls())]


class Taps:
    """The regions' taps of a replayed batch as one: their reads, and where their gradients go."""

    def __init__(self, regions: Iterable[Any]):
        self.regions = list(regions)

    def reads(self) -> list:
        reads = [u for r in self.regions for u in r.reads()]
        if any(isinstance(r, RootReads) for r in self.regions):
            return in_order(reads)  # the root's among the regions' as the forward made them
        return reads

    def reading(self, on_grad) -> None:
        for r in self.regions:
            r.reading(on_grad)
