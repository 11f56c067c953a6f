"""Python's branches on the batch's values: ``if h.sum() > 0:``, ``if mask.all():``. The
batch's forward took one way for every example; each example run alone takes the way its own
values say, and where that is another way its gradient is another one. No trace can follow a
branch (the ``numel()`` a condition compares with is the batch's, not an example's), so the
examples are checked (``ways.py``): the trace keeps every boolean the forward read on the host,
in order (``Branches``), and which of them came from the batch's values. Where such a one is an
``all()`` or ``any()`` of a tensor each element of which is one example's (transformers' ``if
mask.all()`` shortcut, and its ``fast_all``), each example's own value of it is that of its own
elements (``own``), and no example runs alone to read it; a replayed batch's witness keeps the
tensor it reduced for the same (``replay/owned.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .owners import MIXED

# comparisons: of an id the batch hit with a number, the id's own truth (``Branches.after``)
COMPARING = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
COMPARING |= {f"__{name}__" for name in COMPARING}
# ops whose result may be a truth each example alone shares
_BOUNDS = {"max": "max", "amax": "max", "min": "min", "amin": "min"}
IMPLYING = frozenset({"all", "any", "sum", *_BOUNDS}) | COMPARING


class Branches:
    """The booleans a forward read on the host (``Tensor.__bool__``, ``.item()``, ``equal``,
    ``in``), in order, as the examples run alone must read them; and where one of the batch's
    is an ``all()``/``any()`` of a tensor each element of which is one example's, each
    example's own value of it (``own``), so that no example need run alone to read it."""

    def __init__(self, batch: int = 0) -> None:
        self.batch = batch
        self.values: list[bool] = []
        # each one's index among the finder's host reads; None: a value the batch's shapes
        # decide (the same on every batch of the signature), or read with no finder
        self.hosts: list[int | None] = []
        self.doubted = 0  # how many, up to the last one read from the batch's values
        self.doubts: list[int] = []  # which of them were read from the batch's values
        self.own: list[Tensor | None] = []  # each one's examples' own values (B,), or None
        # id -> (tensor, what it is, (the tensor reduced, its owners, "all" or "any") or None)
        self._kinds: dict[int, tuple[Tensor, object, tuple | None]] = {}

    def read(self, value: bool, of_batch: bool, host: int | None, x: object = None) -> Own:
        """Notes one read of ``value`` from ``x``; of the batch's values, returns how each
        example's own value of it is computed from the tensor reduced, where it can be."""
        self.values.append(value)
        self.hosts.append(host)
        if not of_batch:
            return None
        self.doubted = len(self.values)
        self.doubts.append(len(self.values) - 1)
        kept = self._kinds.get(id(x))
        source = kept[2] if kept is not None and kept[0] is x else None
        if source is None or (owners := _apart(source[1], source[0].shape, self.batch)) is None:
            self.own.append(None)
            return None
        self.own.append(own(source[0], owners, source[2], self.batch))
        return owners, source[2]

    def after(self, owners: Tensor | None, name: str, args: tuple, kwargs: dict, out, hit: bool):
        """Notes ``out``, one element that op ``name`` made of the tensor ``args[0]``, where its
        truth for the batch is each example's alone: ``all()`` of a tensor whose every element
        is one example's or none's (``owners``), true, as each example's share of it is;
        ``any()`` of one, false; ``x.sum() == x.numel()`` of such a boolean ``x``,
        transformers' ``fast_all``; its ``max()`` and ``min()``, bounds of each example's
        (``bound``); and an id the batch hit (``hit``) compared with a number (Mixtral's ``if
        e == num_experts:`` in its loop over them, whose rows each id's own: ``routes.py``).
        An ``all()``, ``any()`` or ``fast_all`` keeps what it reduced (``read``)."""
        if kwargs:
            return
        x, n = args[0], args[1] if len(args) == 2 else None
        if name in COMPARING:
            if hit and isinstance(n, (int, float)):
                self._kinds[id(out)] = (out, "hit", None)
            elif name in ("eq", "__eq__") and (kind := self._kind(x)) is not None and kind == n:
                # a count of True: n an int, not a bool
                self._kinds[id(out)] = (out, "all", self._kinds[id(x)][2])
            return
        if len(args) != 1 or owners is None or bool((owners == MIXED).any()):
            return
        if name == "sum":
            if x.dtype == torch.bool:
                self._kinds[id(out)] = (out, x.numel(), (x, owners, "all"))
        elif name in ("all", "any"):
            self._kinds[id(out)] = (out, name, (x, owners, name))
        else:  # a bound: max, min (``bound``)
            self._kinds[id(out)] = (out, _BOUNDS[name], None)

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

    @property
    def owned(self) -> tuple[list[int], list[Tensor]] | None:
        """Which reads are of the batch's values, and each example's own value of each, where
        every one has them (``read``); else None (the examples run alone to read them)."""
        return owned(self.doubts, self.own)


def owned(doubts: Sequence[int], own: Sequence[Tensor | None]) -> tuple | None:
    """``(doubts, own)`` where each read of the batch's values ``doubts`` has its examples' own
    values in ``own``; else None (the examples run alone to read them)."""
    whole = len(own) == len(doubts) and all(o is not None for o in own)
    return (doubts, own) if whole and own else None


# how each example's own value of a read is computed: the owners of the tensor reduced, and
# "all" or "any"
Own = tuple[Tensor, str] | None


def _apart(owners: Tensor, shape: torch.Size, batch: int) -> Tensor | None:
    """``owners`` where every element of a tensor of ``shape`` is one example's and each
    example has one at least; else None."""
    flat = owners.expand(shape).reshape(-1)
    if flat.numel() == 0 or bool((flat < 0).any()):
        return None
    counts = torch.zeros(batch, dtype=torch.long, device=flat.device)
    return owners if bool((counts.index_add_(0, flat, torch.ones_like(flat)) > 0).all()) else None


def own(x: Tensor, owners: Tensor, reducer: str, batch: int) -> Tensor:
    """(B,) each example's own ``all()`` (``reducer``, or ``any()``) of ``x``, every element of
    which is one example's (``owners``, as ``_apart`` passed them)."""
    flat = owners.to(x.device).expand(x.shape).reshape(-1)
    values = x.detach().reshape(-1).bool()
    counted = ~values if reducer == "all" else values
    counts = torch.zeros(batch, dtype=torch.long, device=x.device)
    counts.index_add_(0, flat, counted.long())
    return counts == 0 if reducer == "all" else counts > 0
