"""The full analysis of one batch: a forward with every op traced (``trace.py``), every call of
the rule-served modules captured (``session.py``) and every read of a watched parameter served
where a function reads it (``tap.py``); then the checks that the rows policy's choices held on
this batch, each of which runs the batch again without the choice that failed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...errors import ConfigError, ModelError
from ..capture import Captured, counter
from ..constants import Constants
from ..hooks import ModuleHooks
from ..plan import BROADCAST, ParamPlan, Plan
from ..record import Findings, Record
from ..running import made
from ..state import State
from . import decide
from .bytensor import ByTensor
from .finder import Finder
from .selfcheck import COMPUTED, PLAIN, agrees, check_alone
from .session import HookSession
from .tap import ParamTap
from .trace import RowTrace
from .ways import check_branches

# (inputs, targets) -> ((B,) losses with their graph, what ``observe`` read)
Losses = Callable[[tuple[Tensor, ...], Tensor], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class Analysed(Captured):
    """What the forward of an analysed batch recorded, and what the analysis found in it."""

    trace: RowTrace  # which example each row is
    finder: Finder  # the regions' finder
    at_start: int  # autograd's counter before the forward
    at_end: int  # ... after the losses
    state: State  # the model's state as the forward began

    @property
    def expanded(self) -> bool:
        """A call's or read's rows shared by the batch were expanded to it."""
        return self.session.expanded or (self.tap is not None and self.tap.expanded)

    @property
    def assumed(self) -> bool:
        """A call's or read's rows were taken as the examples'."""
        return self.session.assumed or (self.tap is not None and self.tap.assumed)

    @property
    def per_example(self) -> bool:
        """Each loss is one example's, by the trace."""
        return self.trace.per_example(self.losses, len(self.losses))


class Analysis:
    """Analyses batches of ``plan``'s model (``modules``: its own, in order); ``losses`` runs
    its forward and loss."""

    def __init__(
        self,
        model: nn.Module,
        modules: tuple[nn.Module, ...],
        plan: Plan,
        record: Record,
        losses: Losses,
        hooks: ModuleHooks | None = None,
    ):
        self.model, self.plan, self.record, self.losses = model, plan, record, losses
        self.modules = modules  # the Engine's, whose state a program replays at
        self.made = self.made_of()  # the modules and parameters the plan was made from
        self.hooks = hooks  # the Engine's module hooks, lent to each batch's session
        # sharded (``fsdp.py``): every rank runs the same passes, so no example runs alone to
        # check a branch (its forward's collectives would meet another rank's other pass)
        self.sharded = False

    def made_of(self) -> tuple:
        """The ids of the model's modules and parameters now (``running.made``)."""
        return made(self.model)

    def __call__(
        self, inputs: tuple[Tensor, ...], targets: Tensor, findings: Findings, train: bool = False
    ) -> Analysed:
        """The batch's forward, recorded, once every check holds; then the parameters the rules
        cannot serve on it moved to the fallback. ``train``: a training step's, whose batch
        gradient its backward takes (a graph kept, every parameter on the fallback too)."""
        if self.made_of() != self.made:  # a plan's parameters but not the model's
            raise ModelError(
                "the model's modules or parameters are not those this Engine was made for (one "
                "was replaced since): make a new Engine for the model as it is now",
                "model",
            )
        checks = (self._same_losses, self._expanded_kept, self._assumed_kept, self._not_edited)
        while True:
            try:
                captured = self._recorded(inputs, targets, findings, train)
            except ModelError:
                if findings.expand is False:
                    raise
                findings.expand = False  # the model cannot take the expanded rows: run as is
                continue
            if all(check(captured, inputs, targets, findings) for check in checks):
                break
        trace = captured.trace
        if not captured.per_example or trace.slabbed or trace.noted.lost:
            self._examples_alone(inputs, targets, captured)
        elif trace.branches.doubted and not self.sharded:  # each example's way: its own?
            asked, owned = trace.branches.asked, trace.branches.owned
            check_branches(self.losses, inputs, targets, captured.losses, asked, owned)
        decide.before_backward(self.plan, captured)
        return captured

    def _examples_alone(self, inputs: tuple[Tensor, ...], targets: Tensor, captured: Analysed):
        """Where the trace finds the losses mixing examples, whether they do: two examples run
        alone must each give their loss in the batch (the trace may only have lost track, and
        then the fallback is exact); where a loop over the ids the batch hit picked slabs
        (``selectors.py``), or a number of the batch's left the trace as a plain one
        (``tags.Noted``), every example. A loss or model that mixes them (``l - l.mean()``,
        a sum over every hit id's slab) has no per-example gradient: refused, not scored as
        each example alone. Sharded, refused: an example run alone on one rank would meet
        another rank's other pass in the all-gathers."""
        trace = captured.trace
        op = trace.mixed_at(captured.losses)
        after = f" (after {op})" if op else ""
        every = captured.per_example  # the trace could not see what mixes: every example
        if every:
            after = " (after a loop over the ids the batch hit)" if trace.slabbed else PLAIN
        if self.sharded:
            raise ConfigError(
                f"distributed.shard: fsdp: this batch's losses may mix its examples{after}, "
                "which only its examples run alone can rule out, and a sharded pass runs none "
                "alone (each rank must run the same passes): run it unsharded",
                "distributed.shard",
            )
        check_alone(self.losses, inputs, targets, captured.losses, every, after)

    def _recorded(
        self, inputs: tuple[Tensor, ...], targets: Tensor, findings: Findings, train: bool
    ):
        expand, assume = findings.expand is not False, findings.assume
        watched, batch = self.plan.by_rule + self.plan.raw, targets.shape[0]
        trace = RowTrace(batch, (*inputs, targets))
        session = HookSession(
            self.plan.hooked_modules, trace, self.record.copy, expand, assume, self.hooks
        )

        def ruled(p: ParamPlan) -> bool:  # read in a call of its rule's module: the rule's
            return p.rule != BROADCAST and any(session.inside(m) for m, _ in p.owners)

        # a rule-served parameter read outside its module's calls (nn.MultiheadAttention's
        # out_proj) is served where a function reads it, as a raw one is
        tap = ParamTap(watched, batch, trace, ruled, expand, assume) if watched else None
        derived = tap.derived if tap else ByTensor()
        finder = Finder(self.model, session.events, trace, derived, self.record)
        session.log, trace.finder, trace.owners.on_set = finder.log, finder, finder.born
        if tap is not None:
            tap.finder, tap.derived.on_set = finder, finder.born
            tap.constants = Constants(frozenset(id(b) for b in self.model.buffers()))
            finder.constants = tap.constants
        state = State(self.modules)  # as the replay takes it: before any pass's hooks
        # with every parameter on the fallback, this pass only gives the losses (and a training
        # step's batch gradient): no graph but for that
        with (
            torch.set_grad_enabled(bool(watched) or train),
            session,
            finder,
            trace,
            tap or contextlib.nullcontext(),
        ):
            start = counter()
            losses, observed = self.losses(inputs, targets)
            end = counter()
        COMPUTED.set(session.coarsest)  # the checks of this batch compare at its rounding
        return Analysed(session, tap, losses, observed, trace, finder, start, end, state)

    # -- the checks: each True where it holds; where not, the finding that makes the next
    # -- run hold, and False

    def _same_losses(self, captured: Analysed, inputs, targets, findings: Findings) -> bool:
        """On a signature's first batch: the model as written gives the losses the expanded
        calls gave, and a second forward gives them again (else its forward is random)."""
        if findings.expand is not None and findings.deterministic is not None:
            return True
        with torch.no_grad():
            plain = self.losses(inputs, targets)[0]
        same = plain.shape == captured.losses.shape and agrees(captured.losses.detach(), plain)
        if captured.expanded and not same:
            findings.expand = False  # the expanded rows changed a loss: run as is
            return False
        if findings.expand is None:
            findings.expand = True  # tried: it held, or nothing was expanded
        if not same:
            raise ModelError(
                "the model gives other losses for the same batch on a second forward: its "
                "forward is random (masking or noise in eval mode?), or writes its own weights "
                "or buffers (`w.data.mul_`), as these two forwards then did: reload the model; "
                "per-example gradients of such a forward are not defined: make it deterministic "
                "and leave the model as it is",
                "model",
            )
        findings.deterministic = True
        return True

    def _expanded_kept(self, captured: Analysed, inputs, targets, findings: Findings) -> bool:
        """Expanded rows kept each loss to one example (Swin V2's position-bias table, read
        from one example's copy of the expanded rows for all, does not)."""
        if captured.expanded and not captured.per_example:
            findings.expand = False
            return False
        return True

    def _assumed_kept(self, captured: Analysed, inputs, targets, findings: Findings) -> bool:
        """Calls whose rows were taken as the examples' kept each loss to one example."""
        if captured.assumed and not captured.per_example:
            findings.assume = False  # a call's rows were shared after all: run as is
            return False
        return True

    def _not_edited(self, captured: Analysed, inputs, targets, findings: Findings) -> bool:
        """No captured input was edited in place after its call; where one was, its module's
        inputs are copied from now on, and the batch runs again."""
        edited = captured.session.edited_in_place() - self.record.copy
        self.record.copy |= edited
        return not edited
