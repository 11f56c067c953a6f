"""The replayed pass of a batch (``replay/session.py`` runs one program): the signature's
programs tried in turn, the one that held last first, and what a failed witness taught learned
only where none holds the batch (``Record``, ``Lessons``). ``Engine.scores`` calls it first and
analyses the batch in full where it gives None."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ...errors import ModelError
from ..analysis.branches import owned
from ..analysis.seeded import Seeded
from ..analysis.selfcheck import COMPUTED, PLAIN, check_alone
from ..analysis.ways import check_branches
from ..backward.reduce import Reducer, Want
from ..backward.serve import Served, serve, served_calls, uses
from ..capture import Captured
from ..hooks import ModuleHooks
from ..plan import Plan
from ..record import Findings, Lessons, Record
from ..steps import Program, RegionCall
from .intercept import GivenBack, Intercept
from .light import LightRegion
from .routed import RoutedRegion
from .session import Diverged, ReplaySession, Taps

Losses = Callable[[tuple[Tensor, ...], Tensor], tuple[Tensor, dict[str, Tensor]]]


class Replayed:
    """``(inputs, targets, want, findings) -> (Captured, Reducer) | None`` for one model: its
    ``plan``, ``record`` and ``modules``; ``losses`` runs its forward and loss."""

    def __init__(
        self,
        plan: Plan,
        record: Record,
        modules: tuple[nn.Module, ...],
        losses: Losses,
        hooks: ModuleHooks | None = None,
    ):
        self.plan, self.record, self.modules, self.losses = plan, record, modules, losses
        self.kinds = {id(m): type(m) for m in modules}  # a region call's module's class
        self.hooks = hooks  # the Engine's module hooks, lent to each batch's session
        self.holders: dict[int, tuple] = {}  # each parameter's Read, where held (``Intercept``)
        # the region and child modules of the programs replayed, by their ids' sets
        self.found: dict[tuple[frozenset[int], frozenset[int]], tuple[list, list]] = {}

    def __call__(
        self, inputs: tuple[Tensor, ...], targets: Tensor, want: Want, findings: Findings
    ) -> tuple[Captured, Reducer] | None:
        """The pass with a program of the signature whose witness holds, the one that held last
        tried first (a model whose structure alternates between a few ways has one for each);
        None where none does. What a failed witness taught (values read on the host that
        differ, rows a region lost) is learned from the first program tried, and only where no
        other holds the batch: a program of another way fails for the batch's way, not for the
        model's."""
        moves = len(self.record.moves)
        findings.programs = [p for p in findings.programs if p.moves == moves]  # none stale
        first: Lessons | None = None
        for program in reversed(findings.programs):
            lessons = Lessons()
            passed = self._replay(program, inputs, targets, want, findings, lessons)
            if passed is not None:
                findings.replayed(program)
                return passed
            first = first or lessons
            if len(self.record.moves) != moves:  # a rule failed: every program is stale
                break
        if first is not None:
            findings.diverged(first.why)
            first.teach(self.record)
        return None

    def _replay(
        self,
        program: Program,
        inputs: tuple[Tensor, ...],
        targets: Tensor,
        want: Want,
        findings: Findings,
        lessons: Lessons,
    ) -> tuple[Captured, Reducer] | None:
        """The pass with ``program``, or None where its witness fails (``lessons`` says why)."""
        plan, batch = self.plan, len(targets)
        differs = program.state.differs()
        if differs:  # at another state a forward may make other ops at the same calls
            lessons.why = f"the model's state differs from the analysed batch's ({differs})"
            return None
        session = self._session(program, batch, findings, lessons)
        try:
            with (
                torch.set_grad_enabled(bool(program.uses or want.train)),
                # no Read kept in the model, once the regions are done; none lent where no
                # read is served by recipe
                GivenBack(self.modules) if program.lit else contextlib.nullcontext(),
                session,
            ):
                losses, observed = self.losses(inputs, targets)
            session.finish()
            COMPUTED.set(session.coarsest)  # the checks of this batch compare at its rounding
        except (Diverged, ModelError) as e:  # a ModelError's fault: the analysis runs it again
            lessons.why = str(e)
            session.unlink()
            return None
        captured = Captured(session, Taps(session.done), losses, observed)
        if program.varies:  # what the regions read and called differs batch to batch
            reads = captured.tap.reads()
            count = uses(plan, served_calls(plan, captured), reads)
            checked = [p for p in plan.by_rule + plan.raw if not count[p.name]]
        else:  # the analysed calls, and the light regions' reads in the analysed order
            reads, count = captured.tap.reads(), dict(program.uses)
            checked = [plan.find(name) for name in program.checked]
        trained = program.trained if program.requests is not None else None
        done = Served(count, checked, program.requests, trained)
        reducer, grads = serve(plan, captured, want, done, reads)
        session.unlink()
        for p in plan.fallback:  # a rule that failed on this batch
            reducer.forget(p.name)
        if any(g is not None for g in grads):  # a gradient where no call reached: analyse
            lessons.why = "a parameter reached the loss where no call or read did"
            return None
        if program.alone:  # the same plain number read: alone, each example may read another
            check_alone(self.losses, inputs, targets, losses, True, PLAIN)
        elif program.branches:  # the same branches taken: alone, each example may take another
            own = owned(program.doubts, session.owned)  # where every read's own was seen
            check_branches(self.losses, inputs, targets, losses, program.branches, own)
        return captured, reducer

    def _session(
        self, program: Program, batch: int, findings: Findings, lessons: Lessons
    ) -> ReplaySession:
        """The replay session of ``program`` over this batch's forward: its regions, children,
        the buffers a light region may need, and where its regions are made."""
        plan = self.plan
        regions, children = self._modules_of(program)
        buffers = frozenset()  # ids of the model's buffers, where a light region may need them
        if program.lit:
            buffers = frozenset(id(b) for m in self.modules for b in m._buffers.values())
        session = ReplaySession(
            plan.hooked_modules,
            regions,
            program,
            batch,
            self.record.copy,
            plan=plan,
            buffers=buffers,
            branched=functools.partial(setattr, lessons, "branched", True),
            hooks=self.hooks,
            children=children,
            intercept=self._intercept(None, lessons),
        )
        session.make_region = lambda call, tensors: self._region(
            call, tensors, findings, lessons, session
        )
        return session

    def _modules_of(self, program: Program) -> tuple[list[nn.Module], list[nn.Module]]:
        """``program``'s region modules and its children's, looked up among the model's once
        for each such pair of sets (``found``)."""
        key = (program.regions, program.children)
        if key not in self.found:
            self.found[key] = (
                [m for m in self.modules if id(m) in program.regions],
                [m for m in self.modules if id(m) in program.children],
            )
        return self.found[key]

    def _region(
        self,
        call: RegionCall,
        tensors: list[Tensor],
        findings: Findings,
        lessons: Lessons,
        session: ReplaySession,
    ):
        """A region call's own pass: by its recipes (following its rows where values pick
        them), or under a trace and a tap again."""
        batch = session.batch
        kind = self.kinds[call.module]
        traced = functools.partial(lessons.traced.add, kind)  # where its rows do not hold
        if call.routed:
            during = None if call.open else call.during  # None: reads matched by kind
            copy, root = self.record.copy, call.module == id(self.modules[0])
            args = (self.plan, call.light, during, batch, tensors, call.entry, traced, copy, root)
            return RoutedRegion(*args)
        if call.light is not None:
            made = [t for t, c in zip(tensors, call.constant, strict=False) if c]
            return LightRegion(
                self.plan,
                call.light,
                call.during,
                batch,
                session._ruled,
                session.buffers,
                made,
                call.hosts,
                traced,
                self._intercept(kind, lessons),
                session.owned,
            )
        copy = self.record.copy
        root = call.module == id(self.modules[0])
        return Seeded(self.plan, findings, copy, batch, tensors, call.entry, session.inside, root)

    def _intercept(self, kind: type | None, lessons: Lessons) -> Intercept | None:
        """Where the reads of a light region of ``kind`` (None: the model's top level) are
        intercepted (``intercept.py``), what is told when they fail: the kind is then read
        under the mode, whose witness sees every op; None where it is already."""
        if kind in self.record.moded:
            return None
        return Intercept(functools.partial(lessons.moded.add, kind), self.holders)
