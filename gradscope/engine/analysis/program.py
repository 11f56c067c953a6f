"""The replay program of an analysed batch (``passes/replay.py``), where its outcome holds for
every batch of the signature; and, where it does not, why."""

from __future__ import annotations

from collections.abc import Sequence

from ..capture import Captured
from ..passes.backward import Requests
from ..passes.replay import Program, Step
from .session import Entered, HookSession


def replayable(captured: Captured) -> str | None:
    """Why a later batch of this one's signature may run other ops or owners, or None."""
    trace, tap = captured.trace, captured.tap
    if trace.escapes:
        return f"the forward reads the batch's values on the host ({', '.join(trace.escapes)})"
    if trace.picked_by:
        return f"rows picked by the batch's values ({trace.picked_by})"
    if tap is not None and tap.reads():
        return "parameters read outside their modules' calls"
    return None


def program_of(
    captured: Captured,
    requests: Requests,
    checked: Sequence[str],
    uses: dict[str, int],
    moves: int,
) -> Program:
    """The program of an analysed batch that ``replayable`` passed."""
    session = captured.session
    assert isinstance(session, HookSession)
    steps = tuple(_step(e) for e in session.events)
    tail = session.made_since(captured.losses.grad_fn)
    return Program(steps, requests, tuple(checked), tuple(uses.items()), tail, moves)


def _step(e: Entered) -> Step:
    c = e.call
    shape = None if c is None else tuple(c.shape)
    rows, nodes = (None, None) if c is None else (c.rows, c.nodes)
    return Step(id(e.module), e.shapes, e.handed, e.expand, shape, rows, nodes)
