"""Python's branches on the batch's values: ``if h.sum() > 0:``, ``if mask.all():``. The
batch's forward took one way for every example; each example run alone takes the way its own
values say, and where that is another way its gradient is another one. No trace can follow a
branch (the ``numel()`` a condition compares with is the batch's, not an example's), so the
check runs the examples: the trace keeps every boolean the forward read on the host, in order
(``Branches``), and where one of them came from the batch's values, each example is run alone
(no gradient) until it has read as many, each compared with the batch's (``check_branches``);
one that reads another, or fewer, is run whole and must give its loss in the batch, or the
batch is refused; those that first read another value at the same read run whole together
where, as a batch of their own, they read just what each reads alone (``_together``).
transformers' ``if mask.all()`` shortcut, read on every batch given an attention mask, costs
a forward of the model's first ops (its embeddings and masks) per example, and one whole
forward of those with nothing padded, who take the shortcut alone to the loss they have in
the batch.

A replayed batch (``replay/programs.py``) reads the analysed batch's booleans where its witness
compares them (outside every region call, or in a light one), so it runs the same check
against the analysed values (``Program.branches``); where one of them is read inside a traced
or routed region, which the witness does not compare, its every example is run whole
(``Program.alone``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ...errors import ModelError
from ..ops import SCALAR_READS, op_name
from .owners import MIXED
from .selfcheck import agrees, example, one_alone


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


# comparisons: of an id the batch hit with a number, the id's own truth (``Branches.after``)
COMPARING = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
COMPARING |= {f"__{name}__" for name in COMPARING}
# ops whose result may be a truth each example alone shares
_BOUNDS = {"max": "max", "amax": "max", "min": "min", "amin": "min"}
IMPLYING = frozenset({"all", "any", "sum", *_BOUNDS}) | COMPARING


class Branches:
    """The booleans a forward read on the host (``Tensor.__bool__``, ``.item()``, ``equal``,
    ``in``), in order, as the examples run alone must read them."""

    def __init__(self) -> None:
        self.values: list[bool] = []
        # each one's index among the finder's host reads; None: a value the batch's shapes
        # decide (the same on every batch of the signature), or read with no finder
        self.hosts: list[int | None] = []
        self.doubted = 0  # how many, up to the last one read from the batch's values
        self._kinds: dict[int, tuple[Tensor, object]] = {}  # id -> (tensor, what it is)

    def read(self, value: bool, of_batch: bool, host: int | None) -> None:
        self.values.append(value)
        self.hosts.append(host)
        if of_batch:
            self.doubted = len(self.values)

    def after(self, owners: Tensor | None, name: str, args: tuple, kwargs: dict, out, hit: bool):
        """Notes ``out``, one element that op ``name`` made of the tensor ``args[0]``, where its
        truth for the batch is each example's alone: ``all()`` of a tensor whose every element
        is one example's or none's (``owners``), true, as each example's share of it is;
        ``any()`` of one, false; ``x.sum() == x.numel()`` of such a boolean ``x``,
        transformers' ``fast_all``; its ``max()`` and ``min()``, bounds of each example's
        (``bound``); and an id the batch hit (``hit``) compared with a number (Mixtral's ``if
        e == num_experts:`` in its loop over them, whose rows each id's own: ``routes.py``)."""
        if kwargs:
            return
        x, n = args[0], args[1] if len(args) == 2 else None
        if name in COMPARING:
            if hit and isinstance(n, (int, float)):
                self._kinds[id(out)] = (out, "hit")
            elif name in ("eq", "__eq__") and (kind := self._kind(x)) is not None and kind == n:
                self._kinds[id(out)] = (out, "all")  # a count of True: n an int, not a bool
            return
        if len(args) != 1 or owners is None or bool((owners == MIXED).any()):
            return
        if name == "sum":
            if x.dtype == torch.bool:
                self._kinds[id(out)] = (out, x.numel())
        else:  # all, any; a bound: max, min (``bound``)
            self._kinds[id(out)] = (out, _BOUNDS.get(name, name))

    def bound(self, x: Tensor) -> str | None:
        """``max`` or ``min`` where ``x`` is that of a tensor whose every element is one
        example's or none's: each example's own is within it (``tags.Read.bound``)."""
        kind = self._kind(x)
        return kind if kind in ("max", "min") else None

    def implied(self, x: Tensor, value: bool) -> bool:
        """Whether ``value``, read from ``x``, is each example's alone, or an id's own
        (``after``)."""
        kind = self._kind(x)
        return kind == "hit" or kind == ("all" if value else "any")

    def _kind(self, x: object) -> object:
        """What ``after`` noted ``x`` is, or None (an id reused by another tensor: None)."""
        kind = self._kinds.get(id(x))
        return kind[1] if kind is not None and kind[0] is x else None

    @property
    def asked(self) -> tuple[bool, ...]:
        """The values each example alone must read: up to the last of the batch's."""
        return tuple(self.values[: self.doubted])


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
) -> None:
    """Each example run alone by ``run`` (inputs, targets -> (losses, ...)) must read the
    booleans ``asked`` as the batch did, or give its loss in the batch, ``losses``, run whole;
    else the batch is refused as mixing its examples. Those that first read another value at
    the same read run whole together (``_together``): many examples with nothing padded, one
    forward."""
    with torch.no_grad():
        ways = [_way(run, inputs, targets, i, asked) for i in range(len(targets))]
        kept = [i for i, way in enumerate(ways) if isinstance(way, Tensor)]
        if kept:
            read = torch.cat([ways[i] for i in kept]).tolist()
            for i, value in zip(kept, read, strict=True):
                ways[i] = True if value == asked[-1] else len(asked) - 1
        apart: dict[int | None, list[int]] = {}  # by the read each differs at (None: fewer)
        for i, way in enumerate(ways):
            if way is not True:
                apart.setdefault(way, []).append(i)
        for at, examples in apart.items():
            if at is not None and len(examples) > 1:
                read = (*asked[:at], not asked[at])
                examples = _together(run, inputs, targets, losses, examples, read)
            for i in examples:  # another way alone: its loss must hold
                one_alone(run, inputs, targets, losses, i, branched)


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
    picked = tuple(t.index_select(0, index.to(t.device)) for t in inputs)
    reads = _Reads()
    with reads:
        theirs = run(picked, targets[index])[0]
    if tuple(reads.read) != read:
        return examples
    batch = losses.detach()[index]
    return [i for k, i in enumerate(examples) if not agrees(theirs[k : k + 1], batch[k : k + 1])]
