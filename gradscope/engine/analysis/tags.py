"""Python numbers read from the batch's values on the host that carry the owners of the values
that gave them: ``.item()``'s and ``.tolist()``'s integers (``Read``) and floats
(``ReadFloat``), handed out by ``readback.py``, and what Python's arithmetic makes of them
(``k + 1``, ``-k``, ``k % n``, ``s * 2``, ``round(s)``): a result takes the owner of its tagged
operands, an example's where each is that example's, MIXED where they are several.

``int()`` and ``float()`` must return plain numbers: what they return is noted by value in
the trace's ``Noted``, as ``int(t)`` of a tensor is. An order, an equality or a truth (``k >
3``, ``k == n``, ``if k:``, a dictionary looked up by ``k``) is a branch Python may take on the
batch's values, which no trace follows: it counts as lost (``branches.py`` checks the branches
torch's booleans take). What leaves Python's operators is plain: ``math.sqrt(k)`` reads an
integer by ``float()``, noted, but a float without a word, so a float of the batch's counts as
lost as soon as it is made (``Noted.lost``)."""

from __future__ import annotations

from .owners import MIXED, NONE

HIT = -3  # the owner of an id the batch hit, read (``routes.py``): every example's alike


class Noted:
    """The plain numbers host reads gave, by value: each one's owners (every example whose
    read gave it; ``MIXED`` for a value several examples' gave)."""

    def __init__(self) -> None:
        self.ints: dict[int, set[int]] = {}
        self.floats: dict[float, set[int]] = {}
        # whether a number of the batch's left as a plain one, or a float of the batch's was
        # made (``tagged``): what Python derives from it (``int(t) + 1``, ``math.sqrt(s)``)
        # no one follows, so each batch's every example is checked alone (``analyse.py``, the
        # replay: ``Program.alone``)
        self.lost = False
        self.handed = False  # whether a number tagged with an example's owner was handed out

    def add(self, value: object, owner: int) -> None:
        """``value``, which a read of ``owner``'s values gave as a plain number; whole floats
        count as integers too (``W[int(float(t))]``), other floats only as floats (a plain
        ``0.5`` or ``1.0`` of the model's own is too common to match by value)."""
        if isinstance(value, bool) or owner in (NONE, HIT):
            return
        self.lost = True
        if isinstance(value, float) and not value.is_integer():
            self.floats.setdefault(value, set()).add(owner)
        elif isinstance(value, (int, float)):
            self.ints.setdefault(int(value), set()).add(owner)


def joined(a: int, b: int) -> int:
    """The owner of a number computed from numbers of owners ``a`` and ``b``."""
    return a if b in (NONE, a) else b if a == NONE else MIXED


def tagged(value: object, owner: int, noted: Noted | None = None) -> object:
    """``value`` tagged with ``owner`` where it is a number of someone's; else as it is."""
    if isinstance(value, bool) or owner == NONE:
        return value
    if noted is not None:
        noted.handed = True
    if isinstance(value, int):
        return Read(value, owner, noted)
    if not isinstance(value, float):
        return value
    if noted is not None and owner != HIT:  # ``math.sqrt(s)`` reads it without ``__float__``
        noted.lost = True
    return ReadFloat(value, owner, noted)


def plain(value: object) -> object:
    """A tagged number as the plain one it is, for the analysis's own records: their
    comparisons are not the model's (``__eq__`` of a tagged one counts as a branch)."""
    if isinstance(value, Read):
        return int.__index__(value)
    return float.__float__(value) if isinstance(value, ReadFloat) else value


def owner_of(value: object) -> int:
    """A number's owner: its tag's, ``NONE`` for a plain one."""
    return value.owner if isinstance(value, (Read, ReadFloat)) else NONE


def _binary(plain):
    def op(self, other, *rest):
        out = plain(self, other, *rest)
        if out is NotImplemented:
            return out
        owner = joined(self.owner, owner_of(other))
        if isinstance(out, tuple):  # divmod
            return tuple(tagged(v, owner, self.noted) for v in out)
        return tagged(out, owner, self.noted)

    return op


def _unary(plain):
    def op(self, *rest):
        return tagged(plain(self, *rest), self.owner, self.noted)

    return op


def _converted(plain):
    def op(self):
        out = plain(self)
        if self.noted is not None:
            self.noted.add(out, self.owner)
        return out

    return op


def _compared(plain):
    def op(self, *rest):
        out = plain(self, *rest)
        if self.noted is not None and self.owner != HIT and not _within(self, plain, out, rest):
            self.noted.lost = True  # Python may branch on it: each example checked whole
        return out

    return op


def _within(read: Read, plain, out: object, rest: tuple) -> bool:
    """Whether ``out``, an order of the batch's bound ``read`` and a plain number, holds for
    each example's own too: ``k <= n`` true of a maximum (XLM's ``assert lengths.max().item()
    <= slen``), ``k >= n`` true of a minimum."""
    wanted = {"max": ("__le__", "__lt__"), "min": ("__ge__", "__gt__")}.get(read.bound, ())
    return out is True and plain.__name__ in wanted and owner_of(rest[0]) == NONE


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "divmod", "pow")
_BINARY += ("and", "or", "xor", "lshift", "rshift")
_UNARY = ("neg", "pos", "abs", "invert", "round", "floor", "ceil", "trunc")


def _arithmetic(base: type) -> dict:
    """The dunders of ``base`` that make numbers, each tagging its result."""
    ops = {}
    for name in _BINARY:
        for dunder in (f"__{name}__", f"__r{name}__"):
            if hasattr(base, dunder):
                ops[dunder] = _binary(getattr(base, dunder))
    for name in _UNARY:
        if hasattr(base, f"__{name}__"):
            ops[f"__{name}__"] = _unary(getattr(base, f"__{name}__"))
    ops |= {"__int__": _converted(base.__int__), "__float__": _converted(base.__float__)}
    # an order, an equality or a truth: a branch (``if k > 3:``, ``if k == n:``, and a
    # dictionary looked up by ``k``), which no trace follows; the analysis keeps ``plain`` ones
    compared = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")
    ops |= {d: _compared(getattr(base, d)) for d in compared}
    ops["__bool__"] = _compared(base.__bool__)
    return ops


class Read(int):
    """An integer read from the batch's values: its ``owner`` (an example, or MIXED) and the
    trace's ``noted``, told of its value where ``int()`` or ``float()`` makes it plain."""

    owner: int
    noted: Noted | None
    bound: str | None = None  # "max" or "min" of a tensor of the examples' (``branches.py``)

    def __new__(cls, value: int, owner: int = MIXED, noted: Noted | None = None) -> Read:
        read = super().__new__(cls, value)  # a copy's owner: of no one known, MIXED
        read.owner, read.noted = owner, noted
        return read


class ReadFloat(float):
    """A float read from the batch's values, as ``Read`` is an integer."""

    owner: int
    noted: Noted | None
    bound: str | None = None  # as Read's: ``if x.max().item() > 0.9:`` asks it

    def __new__(cls, value: float, owner: int = MIXED, noted: Noted | None = None) -> ReadFloat:
        read = super().__new__(cls, value)
        read.owner, read.noted = owner, noted
        return read


for _tag in (Read, ReadFloat):
    for _name, _op in _arithmetic(_tag.__base__).items():
        setattr(_tag, _name, _op)
