"""What the passes learn about a model, kept whole for later batches and later Engines: the one
record of decisions.

``per_example_norms`` builds a new Engine on every call, and a CLI run scores many batches: what
one pass decides must hold for every later one, or a later pass could serve a parameter that an
earlier one found the rules cannot (and give it a wrong number). So one ``Record`` per model and
parameter selection keeps every decision: each move to the fallback with its reason (which each
new Engine's plan adopts whole), and the modules whose captured inputs the model edits in place.
Per signature (the shapes, dtypes and devices of a batch's tensors) it keeps ``Findings``, what
costs a pass to learn:
- whether expanding calls on rows shared by the batch leaves every loss as it was;
- whether calls on B rows computed from no example keep each row to one example;
- whether the self-check has run: each rule-served parameter's per-example gradients must add up
  to autograd's batch gradient, and two single examples must match their own backward; and the
  structures of the programs of the batches it ran on, each with the hooked modules' state as
  that batch began: a batch analysed again (its model's state changed since) whose program is
  of one of them, at that state, is not self-checked again;
- the replay programs of the analysed batches (``replay/session.py``), which later batches of the
  signature repeat while their witness holds.

The records live in a weak map keyed by the model: nothing is stored on the user's model, and a
model's record goes when the model does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from .state import State
    from .steps import Program


KEPT = 4  # programs kept per signature, and batches that may find none holds in a row


@dataclass
class Findings:
    """What the analysed batches of one signature found."""

    expand: bool | None = None  # None: not tried yet
    deterministic: bool | None = None  # None: not compared with a second forward yet
    assume: bool = True  # False: a call taken to have one row per example had shared rows
    verified: bool = False  # the self-check has run
    programs: list[Program] = field(default_factory=list)  # the last that held last
    replays: int = 0  # batches replayed
    analyses: int = 0  # batches analysed in full
    divergences: int = 0  # batches whose witness failed with every program, in a row
    why: str | None = None  # why the last such batch's witness failed
    # the structures (``analysis.program.structure``) of the self-checked batches' programs,
    # each with the hooked modules' state as its batch began; the analysed batches whose
    # program was of one of them at that state, not self-checked again
    checked: list[tuple[tuple, State]] = field(default_factory=list)
    repeated: int = 0
    # the parameters whose rule formed each example's gradient on the last training step: the
    # next takes their batch gradient from those (``backward.serve.summed``)
    formed: frozenset[str] = frozenset()

    def learn(self, program: Program) -> None:
        """Keep an analysed batch's program for the next batches of the signature (the few
        used last: a model whose calls differ from batch to batch has a program for each way)."""
        if self.divergences < KEPT:
            self.programs = [*self.programs[-(KEPT - 1) :], program]

    def analysed(self, program: Program | str, kept: tuple | None, hooked: State | None) -> None:
        """A batch analysed in full: its ``program`` kept, or why none is; where it was
        self-checked, its structure (``kept``), its batch begun with the hooked modules at
        ``hooked``."""
        self.analyses += 1
        if not self.verified:  # the self-check could not run: the next batch runs it
            self.why = "the self-check has not run (a loss or gradient not finite)"
        elif isinstance(program, str):
            self.why = program
        else:
            self.learn(program)
            if kept is not None and hooked is not None:
                self.checked = [*self.checked[-(KEPT - 1) :], (kept, hooked)]

    def checked_at(self) -> list[tuple]:
        """The self-checked structures whose hooked modules are in the state they began in."""
        return [kept for kept, hooked in self.checked if hooked.differs() is None]

    def diverged(self, why: str) -> None:
        """No program's witness held: the batch is analysed; after a few in a row the
        signature's batches are analysed from then on (its calls differ batch to batch)."""
        self.why, self.divergences = why, self.divergences + 1
        if self.divergences >= KEPT:
            self.programs.clear()

    def replayed(self, program: Program) -> None:
        """A batch replayed ``program``: the first the next batch tries."""
        self.replays, self.divergences = self.replays + 1, 0
        self.programs = [*(p for p in self.programs if p is not program), program]


@dataclass
class Lessons:
    """What a replay whose witness failed taught about the model: learned only where no other
    program of the signature held the batch."""

    why: str = ""
    branched: bool = False  # values read on the host outside the regions differed
    traced: set[type] = field(default_factory=set)  # region classes whose rows did not hold
    moded: set[type | None] = field(default_factory=set)  # whose intercepted reads failed

    def teach(self, record: Record) -> None:
        record.branchings += self.branched
        record.traced |= self.traced
        record.moded |= self.moded


@dataclass
class Record:
    """Every decision about one model and parameter selection."""

    moves: dict[str, tuple[str, bool]] = field(default_factory=dict)  # Plan.to_fallback's
    copy: set[int] = field(default_factory=set)  # modules whose captured inputs are edited later
    # module classes whose light regions did not hold on a later batch (their rows lost where
    # values picked them, other values read on the host): traced on every batch from then on
    traced: set[type] = field(default_factory=set)
    # light region classes (None: the model's top level) whose reads, intercepted where the
    # parameters are read (``replay/intercept.py``), did not hold: seen by a mode from then on
    moded: set[type | None] = field(default_factory=set)
    # batches whose values read on the host outside the regions matched no kept program's:
    # after the second, such reads are escapes, the calls around them traced
    # (``regions.Finder``); after the first, the batch's own way is witnessed and kept
    branchings: int = 0
    signatures: dict[tuple, Findings] = field(default_factory=dict)

    @property
    def branches(self) -> bool:
        """Whether the values a model reads on the host outside its regions take more ways
        than two programs witness: an analysis treats them as escapes."""
        return self.branchings > 1

    def at(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Findings:
        """The findings for the signature of this batch."""
        key = tuple((t.shape, t.dtype, t.device) for t in (*inputs, targets))
        found = self.signatures.get(key)  # made once: a pass only looks it up
        if found is None:
            found = self.signatures[key] = Findings()
        return found


_RECORDS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Record]] = weakref.WeakKeyDictionary()


def record_for(model: nn.Module, key: tuple) -> Record:
    """The record of ``model`` under the selection ``key``, made empty on first use."""
    return _RECORDS.setdefault(model, {}).setdefault(key, Record())
