"""The random draws of a watched step: every forward the engine runs over one step's batch (the
training forward, the analysis's second forward, a rerun) draws from the random state the step
began in, so dropout's masks are the same in each, and the step leaves torch's generators where
one forward leaves them, as the loop without the watch would. What the step began in, and
whether its forward drew at all, the run record keeps (``watchrecord.py``)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..engine import Drew, Undrawn
from ..errors import ModelError
from .record import rng, set_rng


def same_state(a: dict, b: dict) -> bool:
    """Whether two random states (``record.rng``, byte tensors on the CPU) are the same: the
    CPU's and each GPU's (compared as bytes: a few microseconds, a third of ``equal``'s)."""
    return _bytes(a) == _bytes(b)


def _bytes(state: dict) -> list[bytes]:
    return [t.numpy().tobytes() for t in (state["cpu"], *state["cuda"])]


Kept = dict[str, tuple[Tensor, tuple[Tensor, int]]]  # name: its value, the buffer, its version


class SameBuffers:
    """The model's buffers as a step began, put back before each of its later forwards (a try
    that raised included), and as its first forward left them when it ends: a forward that
    changes them (a counter, spectral norm's power iteration, which a read of the weight
    outside the forward runs too) changes them once a step, as the loop's does. Which ones
    change is learnt from their version counters on the first step, which keeps every buffer;
    a later one keeps those, and refuses one changed for the first time (not kept, it cannot
    be put back)."""

    def __init__(self, model: nn.Module):
        self.slots = {  # name: (its module, its name there)
            f"{prefix}.{local}".lstrip("."): (module, local)
            for prefix, module in model.named_modules()
            for local in module._buffers
        }
        self.changing: set[str] | None = None  # learnt: None until the first step's end
        self.moved: set[str] = set()  # those seen changing on the first step
        self.seen: dict[str, tuple[Tensor | None, int]] = {}  # each buffer, its version
        self.began: Kept = {}  # the kept ones as the step began
        self.left: Kept | None = None  # and as its first forward left them

    def begin(self) -> None:
        self._look()
        self.began, self.left = self._kept(), None

    def first(self) -> None:
        """The step's first forward returned: the buffers as it left them, the step's end's
        (none to keep where none changes: the step's end then only checks)."""
        if self.changing is None or self.changing:
            self._note()
            self.left = self._kept()

    def again(self) -> None:
        """Before a later forward of the step: the buffers as the step began."""
        self._put(self.began)

    def end(self) -> None:
        if self.left is None:
            self._note()
        else:
            self._put(self.left)
        if self.changing is None:
            self.changing = self.moved
        self.began, self.left = {}, None

    def _now(self, name: str) -> Tensor | None:
        module, local = self.slots[name]
        return module._buffers[local]

    def _look(self) -> None:
        self.seen = {n: (t, -1 if t is None else t._version)
                     for n, t in ((n, self._now(n)) for n in self.slots)}  # fmt: skip

    def _kept(self) -> Kept:
        return {
            name: (t.clone(), seen)
            for name, seen in self.seen.items()
            if (t := seen[0]) is not None and (self.changing is None or name in self.changing)
        }

    def _note(self) -> None:
        """The buffers changed since last looked at: learnt on the first step, refused after
        it where none was seen changing then."""
        moved = set()
        for name, (t, version) in self.seen.items():
            now = self._now(name)
            if now is not t or (now is not None and now._version != version):
                moved.add(name)
        new = moved - (self.moved if self.changing is None else self.changing)
        if self.changing is not None and new:
            raise ModelError(
                f"the model changed its buffer {min(new)} for the first time on a step after "
                "its first, where the watch (which runs a step's forward more than once, or "
                "reads its weights outside it) cannot put it back: it would change otherwise "
                "than in the loop",
                "model",
            )
        self.moved |= moved
        self._look()

    def _put(self, kept: Kept) -> None:
        """The buffers changed since ``kept`` was taken as it holds them (only those: another
        may be saved for the backward, as a view)."""
        self._note()
        with torch.no_grad():
            for name, (value, (t, version)) in kept.items():
                now = self._now(name)
                if now is not None and (now is not t or now._version != version):
                    now.copy_(value)
        self._look()


class SameDraws:
    """``forward(model, inputs)`` (the engine's call of the model) with every call between
    ``begin`` and ``end`` drawing from the random state at ``begin``. A call on other rows than
    the step's first (an example run alone: the exact fallback's, or a branch's check) of a
    forward that drew is refused (``Drew``): it cannot draw the masks the batch drew. With
    dropout left out (``Undrawn``: a branch's check made again), a call on any rows must draw
    nothing; a later one on the step's rows must draw as much as the first (a model that
    changed itself in it drew more, or less: refused). A step of one forward (a program's
    replay) costs one read of the state. Each forward after a step's first starts from the
    model's ``buffers`` as the step began too."""

    def __init__(self, forward: Any, buffers: SameBuffers):
        self.forward, self.buffers = forward, buffers
        self.began: State | None = None  # the random state the step began in
        self.after: State | None = None  # and the one its first forward left, once another runs
        self.calls = 0  # the step's forwards that returned
        self.tried = False  # whether one began: one that raised (the analysis tries again)
        self.rows = 0
        self.hosted = False  # whether the last step's forward drew from numpy's or Python's

    def begin(self) -> dict:
        """A step begins: the random state now, which each of its forwards starts from
        (torch's generators', returned, and the host's)."""
        self.began, self.after, self.calls, self.tried = state(), None, 0, False
        self.buffers.begin()
        return self.began[0]

    def end(self, keep: bool = False) -> dict | None:
        """The step ended: the generators left where its first forward left them; with ``keep``,
        torch's state then (None where no forward ran), and whether it drew from the host's
        generators (``hosted``)."""
        after = self.after
        if after is not None:
            set_state(after)
        elif keep and self.calls:
            after = state()  # one forward ran: the generators are where it left them
        if keep and after is not None and self.began is not None:
            self.hosted = not _same_host(self.began[1], after[1])
        self.began = self.after = None
        self.buffers.end()
        return after[0] if keep and after is not None else None

    def __call__(self, model: nn.Module, inputs: tuple[Tensor, ...]) -> Tensor:
        if self.began is None:  # outside a step: as it is
            return self.forward(model, inputs)
        rows = inputs[0].shape[0] if inputs else 0
        if not self.calls:  # the step's first forward to return: where it leaves the generators
            if self.tried:  # is where one leaves them, not where one that raised did
                self._again()
            self.tried = True
            out = self.forward(model, inputs)
            self.calls, self.rows = 1, rows
            self.buffers.first()
            return out
        if self.after is None:
            self.after = state()  # where the first forward left the generators
        if Undrawn.active():
            self._again()
            out = self.forward(model, inputs)
            if not _same(self.began, state()):
                raise ModelError(
                    "the model draws random numbers in its forward other than dropout's, and "
                    "the step runs examples alone to check a branch on the batch's values, "
                    "which cannot draw what the batch drew: watch it without that randomness",
                    "model",
                )
            return out
        if rows != self.rows and not _same(self.began, self.after):
            raise Drew(
                "the model draws random numbers in its forward (dropout), and the step runs "
                "each example alone (a parameter no rule serves, on the exact fallback, or a "
                "branch on the batch's values, which each example may take its own way), "
                "which cannot draw the masks the batch drew: watch it without that randomness",
                "model",
            )
        self._again()
        out = self.forward(model, inputs)
        if rows == self.rows and not _same(self.after, state()):
            raise ModelError(
                "the model drew other random numbers on another forward of the step's batch "
                "than on its first (a forward that changes the model, as BigBird's switch to "
                "full attention on short inputs makes a new layer, whose initial weights are "
                "drawn): the masks the step trained on cannot be drawn again; run the model "
                "once on a batch before watching it",
                "model",
            )
        return out

    def _again(self) -> None:
        """A later forward of the step begins where the step began."""
        set_state(self.began)
        self.buffers.again()


State = tuple[dict, tuple]  # torch's generators' (``record.rng``), numpy's and Python's


def state() -> State:
    """The random state now: torch's generators', and numpy's and Python's global ones, which
    a forward may draw from too (transformers' speech models draw their SpecAugment masks from
    numpy's)."""
    return rng(), (np.random.get_state(), random.getstate())


def set_state(kept: State) -> None:
    set_rng(kept[0])
    np.random.set_state(kept[1][0])
    random.setstate(kept[1][1])


def _same(a: State, b: State) -> bool:
    return same_state(a[0], b[0]) and _same_host(a[1], b[1])


def _same_host(a: tuple, b: tuple) -> bool:
    (_, keys, *rest), (_, other, *more) = a[0], b[0]  # numpy's: its keys, position, gaussian
    return rest == more and a[1] == b[1] and np.array_equal(keys, other)
