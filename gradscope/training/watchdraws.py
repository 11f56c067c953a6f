"""The random draws of a watched step: every forward the engine runs over one step's batch (the
training forward, the analysis's second forward, a rerun) draws from the random state the step
began in, so dropout's masks are the same in each, and the step leaves torch's generators where
one forward leaves them, as the loop without the watch would. What the step began in, and
whether its forward drew at all, the run record keeps (``watchrecord.py``)."""

from __future__ import annotations

from typing import Any

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


class SameDraws:
    """``forward(model, inputs)`` (the engine's call of the model) with every call between
    ``begin`` and ``end`` drawing from the random state at ``begin``. A call on other rows than
    the step's first (an example run alone: the exact fallback's, or a branch's check) of a
    forward that drew is refused (``Drew``): it cannot draw the masks the batch drew. With
    dropout left out (``Undrawn``: a branch's check made again), a call on any rows must draw
    nothing; a later one on the step's rows must draw as much as the first (a model that
    changed itself in it drew more, or less: refused). A step of one forward (a program's
    replay) costs one read of the state."""

    def __init__(self, forward: Any):
        self.forward = forward
        self.began: dict | None = None  # the random state the step began in
        self.after: dict | None = None  # and the one its first forward left, once another runs
        self.calls = 0  # the step's forwards that returned
        self.tried = False  # whether one began: one that raised (the analysis tries again)
        self.rows = 0

    def begin(self) -> dict:
        """A step begins: the random state now, which each of its forwards starts from."""
        self.began, self.after, self.calls, self.tried = rng(), None, 0, False
        return self.began

    def end(self, keep: bool = False) -> dict | None:
        """The step ended: the generators left where its first forward left them; with ``keep``,
        that state (None where no forward ran)."""
        after = self.after
        if after is not None:
            set_rng(after)
        elif keep and self.calls:
            after = rng()  # one forward ran: the generators are where it left them
        self.began = self.after = None
        return after if keep else None

    def split(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        return self.forward.split(inputs)  # the fallback's vmap calls the model with these

    def select(self, outputs: Any) -> Tensor:
        return self.forward.select(outputs)

    def __call__(self, model: nn.Module, inputs: tuple[Tensor, ...]) -> Tensor:
        if self.began is None:  # outside a step: as it is
            return self.forward(model, inputs)
        rows = inputs[0].shape[0] if inputs else 0
        if not self.calls:  # the step's first forward to return: where it leaves the generators
            if self.tried:  # is where one leaves them, not where one that raised did
                set_rng(self.began)
            self.tried = True
            out = self.forward(model, inputs)
            self.calls, self.rows = 1, rows
            return out
        if self.after is None:
            self.after = rng()  # where the first forward left the generators
        if Undrawn.active():
            set_rng(self.began)
            out = self.forward(model, inputs)
            if not same_state(self.began, rng()):
                raise ModelError(
                    "the model draws random numbers in its forward other than dropout's, and "
                    "the step runs examples alone to check a branch on the batch's values, "
                    "which cannot draw what the batch drew: watch it without that randomness",
                    "model",
                )
            return out
        if rows != self.rows and not same_state(self.began, self.after):
            raise Drew(
                "the model draws random numbers in its forward (dropout), and the step runs "
                "each example alone (a parameter no rule serves, on the exact fallback, or a "
                "branch on the batch's values, which each example may take its own way), "
                "which cannot draw the masks the batch drew: watch it without that randomness",
                "model",
            )
        set_rng(self.began)
        out = self.forward(model, inputs)
        if rows == self.rows and not same_state(self.after, rng()):
            raise ModelError(
                "the model drew other random numbers on another forward of the step's batch "
                "than on its first (a forward that changes the model, as BigBird's switch to "
                "full attention on short inputs makes a new layer, whose initial weights are "
                "drawn): the masks the step trained on cannot be drawn again; run the model "
                "once on a batch before watching it",
                "model",
            )
        return out
