"""Each example's way at the batch's branches (``branches.py``): run alone (no gradient) until
it has read as many booleans as the batch read up to the last of its values, each compared with
the batch's (``_Alone``), or, where each example's own values of them are known
(``Branches.owned``), compared at once; one that reads another, or fewer, is run whole and must
give its loss in the batch, or the batch is refused. Those that first read another value at the
same read run whole together where, as a batch of their own, they read just what each reads
alone (``_together``). transformers' ``if mask.all()`` shortcut, read on every batch given an
attention mask, costs one whole forward of those with nothing padded, who take the shortcut
alone to the loss they have in the batch.

A replayed batch (``replay/programs.py``) reads the analysed batch's booleans where its witness
compares them (outside every region call, or in a light one), so it runs the same check
against the analysed values (``Program.branches``); where one of them is read inside a traced
or routed region, which the witness does not compare, its every example is run whole
(``Program.alone``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...errors import ModelError
from ..ops import SCALAR_READS, op_name
from .selfcheck import agreeing, example, one_alone
from .undrawn import Drew, Undrawn


def branched(i: int, alone: float, in_batch: float) -> ModelError:
    """The refusal of a batch whose example ``i`` takes a branch otherwise alone, to another
    loss."""
    return ModelError(
        f"example {i}'s loss is {alone:.6g} alone and {in_batch:.6g} in its batch: the model "
        "branches on a value of the whole batch (as `if h.sum() > 0:` does), which example "
        f"{i} alone takes the other way, so an example has no gradient of its own; branch on "
        "each example's own values (torch.where), or score batches of one example",
        "model",
    )


class _Read(BaseException):
    """An example's run alone has read what it had to (a ``BaseException``: a model's own
    ``except Exception`` must not swallow it)."""


# reads whose truth the last one asked may be kept as a tensor, read with the others' at once
_KEPT = frozenset({"__bool__", "is_nonzero"})


class _Alone(TorchFunctionMode):
    """An example's forward run alone: each boolean read on the host compared with the batch's,
    in order; stopped (``_Read``) at the first that differs, or at the last one asked, whose
    truth is kept as a tensor (``way``: True, the index of the read it differs at, or that
    tensor), so that the examples' are read together, one wait for the device, not one
    each."""

    def __init__(self, asked: Sequence[bool]):
        super().__init__()
        self.asked, self.seen, self.way = asked, 0, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        last = self.seen == len(self.asked) - 1
        if last and name in _KEPT and args and isinstance(args[0], Tensor) and args[0].numel() == 1:
            self.way = args[0].detach().reshape(1).bool()
            raise _Read
        out = func(*args, **(kwargs or {}))
        if isinstance(out, bool) and name in SCALAR_READS:
            same = out == self.asked[self.seen]
            self.way, self.seen = True if same else self.seen, self.seen + 1
            if not same or self.seen == len(self.asked):
                raise _Read
        return out


class _Reads(TorchFunctionMode):
    """A forward's booleans read on the host, in order (``read``)."""

    def __init__(self):
        super().__init__()
        self.read: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, bool) and op_name(func) in SCALAR_READS:
            self.read.append(out)
        return out


def check_branches(
    run: Callable,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    losses: Tensor,
    asked: Sequence[bool],
    owned: tuple[Sequence[int], Sequence[Tensor]] | None = None,
) -> None:
    """Each example run alone by ``run`` (inputs, targets -> (losses, ...)) must read the
    booleans ``asked`` as the batch did, or give its loss in the batch, ``losses``, run whole;
    else the batch is refused as mixing its examples. ``owned``: which reads are of the batch's
    values, and each example's own value of each ((B,) each), read instead of running it.
    Where ``run`` cannot draw the batch's dropout masks on other rows (``Drew``), the check is
    made again with dropout left out (``undrawn.py``), against those examples' losses the
    batch's way without it."""
    with torch.no_grad():
        apart = None
        try:
            apart = _apart(run, inputs, targets, asked, owned)
            _hold(run, inputs, targets, losses, asked, apart)
        except Drew as drew:
            run = partial(_undrawn, run)
            apart = _apart(run, inputs, targets, asked, owned) if apart is None else apart
            base = _batch_way(run, inputs, targets, losses, asked, apart, drew)
            _hold(run, inputs, targets, base, asked, apart)


def _apart(run: Callable, inputs, targets: Tensor, asked, owned) -> dict[int | None, list[int]]:
    """The examples that take another way alone, by the read each first differs at (None:
    where it reads fewer)."""
    if owned is not None:
        ways = _owned(asked, *owned)
    else:
        ways = [_way(run, inputs, targets, i, asked) for i in range(len(targets))]
        kept = [i for i, way in enumerate(ways) if isinstance(way, Tensor)]
        if kept:
            read = torch.cat([ways[i] for i in kept]).tolist()
            for i, value in zip(kept, read, strict=True):
                ways[i] = True if value == asked[-1] else len(asked) - 1
    apart: dict[int | None, list[int]] = {}
    for i, way in enumerate(ways):
        if way is not True:
            apart.setdefault(way, []).append(i)
    return apart


def _hold(run: Callable, inputs, targets: Tensor, losses: Tensor, asked, apart: dict) -> None:
    """Each example ``apart``, run whole its own way, must give its loss in ``losses``."""
    for at, examples in apart.items():
        if at is not None and len(examples) > 1:
            read = (*asked[:at], not asked[at])
            examples = _together(run, inputs, targets, losses, examples, read)
        for i in examples:  # another way alone: its loss must hold
            one_alone(run, inputs, targets, losses, i, branched)


def _undrawn(run: Callable, *args):
    """``run`` with dropout left out (``Undrawn``)."""
    with Undrawn():
        return run(*args)


def _batch_way(run: Callable, inputs, targets: Tensor, losses: Tensor, asked, apart, drew):
    """``losses`` with those of the examples ``apart`` as ``run`` gives them the batch's way:
    run beside one example that takes it, or else in the whole batch, where that reads the
    batch's booleans ``asked``; else ``drew`` (no check holds without the batch's masks)."""
    examples = sorted(i for group in apart.values() for i in group)
    others = [i for i in range(len(targets)) if i not in set(examples)]
    tries = [[*examples, others[0]]] if others else []
    for rows in [*tries, list(range(len(targets)))]:
        reads = _Reads()
        with reads:
            theirs = run(*_rows(inputs, targets, torch.tensor(rows, device=targets.device)))[0]
        if tuple(reads.read[: len(asked)]) == tuple(asked):
            base = losses.detach().clone()
            base[examples] = theirs.reshape(-1)[[rows.index(i) for i in examples]]
            return base
    raise drew from None


def _owned(asked: Sequence[bool], doubts: Sequence[int], own: Sequence[Tensor]) -> list:
    """Each example's way from its own values at the reads ``doubts`` of the batch's values:
    True, or the first read where it differs (the others, the batch's shapes' or implied, are
    each example's too). One read of them all on the host."""
    wanted = torch.tensor([asked[k] for k in doubts], device=own[0].device)
    differ = torch.stack(own) != wanted[:, None]  # (reads, B)
    first = torch.where(differ.any(0), differ.int().argmax(0), -1).tolist()
    return [True if k < 0 else doubts[k] for k in first]


def _way(run: Callable, inputs, targets: Tensor, i: int, asked: Sequence[bool]):
    """True where example ``i`` alone reads ``asked``; else the index of the read it differs
    at, its last read kept as a tensor (``_Alone``), or None where it reads fewer."""
    alone = _Alone(asked)
    try:
        with alone:
            run(*example(inputs, targets, i))
    except _Read:
        return alone.way
    return None


def _together(
    run: Callable,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    losses: Tensor,
    examples: list[int],
    read: tuple[bool, ...],
) -> list[int]:
    """``examples``, which alone each read ``read`` (the batch's booleans up to the one they
    differ at, then their own), run whole as a batch of their own: where it reads just those
    and no more, it took the way each takes alone, and each whose loss there is its loss in
    the batch holds. Those that do not (all, where it reads otherwise) are left to run alone."""
    index = torch.tensor(examples, device=targets.device)
    reads = _Reads()
    with reads:
        theirs = run(*_rows(inputs, targets, index))[0]
    if tuple(reads.read) != read:
        return examples
    held = agreeing(theirs.reshape(-1), losses.detach()[index])
    return [i for i, same in zip(examples, held, strict=True) if not same]


def _rows(inputs: tuple[Tensor, ...], targets: Tensor, index: Tensor) -> tuple[tuple, Tensor]:
    """The batch's rows ``index``, a batch of their own."""
    return tuple(t.index_select(0, index.to(t.device)) for t in inputs), targets[index]
