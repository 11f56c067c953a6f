"""The replayed pass: a later batch of an analysed signature repeats the analysis's outcome, with
module hooks alone (no owners, no function mode, no host sync), while a witness shows that it
is a batch the analysis describes.

The analysis (``analysis/``) of a batch ends in a ``Program`` where its outcome holds for every
batch of the same signature: what happened at each call of the hooked modules (left to the tap,
rows expanded to the batch, the layout of a row-by-row call's rows), which outputs the backward
requests, and which parameters no call reached. It holds where the analysed forward read none of
the batch's values back to the host (no ``bool(x)``, ``.item()``, ``.tolist()``, ``nonzero``
...: Python's control flow then depends on the shapes alone, so a batch of the same shapes runs
the same ops on the same tensors), moved no rows to places the batch's values pick (indices
computed from the batch, masks, sorts: there the owners hold for those values only), and read
no parameter outside the calls of the modules whose rules serve it (the tap's reads).

Each replayed batch carries a witness, checked as it runs: the same calls of the same modules
with arguments of the same shapes and dtypes in the same order, outputs of the same shapes, no
captured input edited in place, and no gradient reaching a parameter that no call reached. A
batch that breaks it is analysed in full (``Diverged``), and its program joins the signature's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from ..capture import Capture, first_output, shapes_of
from ..rows import Rows
from .backward import Requests


class Diverged(Exception):
    """The batch is not one the program describes: it is analysed in full."""


@dataclass(frozen=True)
class Step:
    """One call of a hooked module as the analysed batch made it."""

    module: int  # id of the module
    shapes: tuple  # (shape, dtype) of its tensor arguments
    handed: bool  # left to the tap: no capture
    expand: bool  # its shared leading rows expanded to the batch
    output: tuple | None  # the shape of its captured output; None: not captured
    rows: Rows | None  # a row-by-row call's layout, where not one row per example
    nodes: int | None  # autograd nodes made since the previous captured call (Call.nodes)


@dataclass(frozen=True)
class Program:
    """What a replayed batch of one signature does: the analysed batch's outcome."""

    steps: tuple[Step, ...]  # every call of the hooked modules, in the order they began
    requests: Requests  # which outputs the backward requests
    checked: tuple[str, ...]  # parameters no call reached: their gradients must stay None
    uses: tuple[tuple[str, int], ...]  # calls serving each parameter (merged where several)
    tail: int | None  # autograd nodes made from the last captured call to the losses
    moves: int  # the record's moves to the fallback when made: a later one retires it


class ReplaySession(Capture):
    """Captures the calls of ``modules`` as ``program`` says, checking the witness as it goes."""

    def __init__(self, modules: Iterable[nn.Module], program: Program, batch: int, copy: set[int]):
        super().__init__(modules)
        self.steps, self.batch, self.copy = program.steps, batch, copy
        self.next = 0
        self.active: dict[int, list[Step]] = {}
        self.diverged: str | None = None

    def diverge(self, why: str) -> None:
        self.diverged = self.diverged or why
        raise Diverged(self.diverged)

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None:
        if self.diverged:  # the model caught our exception: stop at the next call
            raise Diverged(self.diverged)
        step = self.steps[self.next] if self.next < len(self.steps) else None
        if step is None or step.module != id(module):
            self.diverge(f"another call than the analysed batch's: {type(module).__name__}")
        if step.shapes != shapes_of(args):
            self.diverge(f"a call of {type(module).__name__} on other shapes")
        self.next += 1
        self.active.setdefault(id(module), []).append(step)
        if not step.expand:
            return None
        x = args[0]
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        return (rows.expand(self.batch, *rows.shape[1:]), *args[1:])

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        step = self.active[id(module)].pop()
        if step.handed:
            return
        out, _ = first_output(output)
        shape = tuple(out.shape) if isinstance(out, Tensor) and out.requires_grad else None
        if shape != step.output:
            self.diverge(f"a call of {type(module).__name__} with another output")
        if shape is not None:
            copy = id(module) in self.copy
            call = self.record(
                module, args, kwargs, output, copy, expanded=step.expand, rows=step.rows
            )
            if call.nodes != step.nodes:
                self.diverge(f"other operations before a call of {type(module).__name__}")

    def finish(self, losses: Tensor, tail: int | None) -> None:
        """After the forward: every analysed call made, as many operations after the last as
        the analysed batch ran, no captured input edited since."""
        if self.diverged:
            raise Diverged(self.diverged)
        if self.next != len(self.steps):
            self.diverge("fewer calls than the analysed batch's")
        if self.made_since(losses.grad_fn) != tail:
            self.diverge("other operations after the last call")
        edited = self.edited_in_place() - self.copy
        if edited:
            self.diverge("a captured input was edited in place")
