"""The model's own state that a forward may branch on or index by: each module's attributes of
plain values (``training``, flags, modes, counters, tuples of dims, lists and dicts of such) by
value, its other attributes (a function it calls, an object it holds) by identity, the attributes
of the objects it holds (a config a forward reads ``self.config.dim`` from, its sub-configs, a
slotted dataclass's slots) and the entries of its tuples, lists and dicts of more than plain
values (a dict of configs, a list of tensors), ``DEPTH`` levels in, likewise, and the tensors it
keeps (buffers, tensor attributes, and those of what it holds) by identity and by their version
(what autograd counts writes in place by); and beside, what runs the modules' calls (their
classes, children, parameters and hooks: ``running.py``). A program was analysed at one state;
at another, a forward may make other ops at the same calls, shapes and autograd node counts (a
mean over the batch instead of over the features, rows gathered by a permutation the model
keeps), which the witness would not see. So a program replays only at the state its batch began
with; at another the batch is analysed (``replay/programs.py``)."""

from __future__ import annotations

import copy
import enum
import functools
import operator
import types
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .running import Running

# values a branch may read, compared by value (a tensor is not: comparing it costs or syncs; it
# is kept by identity and version instead)
PLAIN = frozenset({bool, int, float, str, type(None), torch.dtype, torch.device})
CONTAINERS = (tuple, list, dict)
# the most plain values a tuple, list or dict may hold to be compared on every batch
LEAVES = 256
# how deep the objects and containers a module holds are followed: its config, the config's
# sub-configs (a vision-language model's text_config), theirs, a dict of them; each is followed
# once, however many hold it, so the bound only stops a walk through a long chain of objects
DEPTH = 8
# what an attribute may hold whose own attributes are not the state's: code, and what the state
# takes in another way (a module is one of the modules; a tensor is kept by identity)
_OPAQUE = (
    nn.Module,
    Tensor,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    enum.Enum,
    dict,  # an OrderedDict of hooks
    list,
    tuple,
    set,
    frozenset,
)


def _leaves(v: object, room: int = LEAVES) -> int | None:
    """How many plain values ``v`` is or holds (a tuple's, a list's, a dict's keys and values,
    nested), or None where it holds anything else, or more than ``room``."""
    if type(v) in PLAIN or isinstance(v, enum.Enum):
        return 1
    if type(v) not in CONTAINERS:
        return None
    total = 0
    for item in (*v.keys(), *v.values()) if type(v) is dict else v:
        n = _leaves(item, room - total)
        if n is None or total + n > room:
            return None
        total += n
    return total


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value no plain value compares to (an array)
        return False


def _version(t: Tensor) -> int:
    """The count of ``t``'s writes in place (an inference tensor keeps none: -1)."""
    try:
        return t._version
    except RuntimeError:
        return -1


# a module's dicts of parameters, buffers, children and hooks: the modules, the tensors and
# the hooks' own code are what they hold, not state a forward reads
_MACHINERY = frozenset(k for k, v in vars(nn.Module()).items() if _leaves(v) is None)
# every attribute nn.Module gives a module (its parameters, buffers, children, hooks): none is
# an object or container whose entries the state follows (its buffers are kept as its tensors)
_OWN = frozenset(vars(nn.Module()))


class _Attributes:
    """One ``__dict__`` of the state's (a module's or an object's it holds), named ``where``:
    its keys, and the values of those that hold no tensor (kept by identity and version
    instead), with the one C call that reads them again and the count of ``buffers`` beside it
    (a module's). Plain values are copied and compared by value (a list may be written in
    place); others (a function, an object) are the ones the forward began with, compared by
    identity."""

    def __init__(self, where: str, d: dict, buffers: dict = types.MappingProxyType({})):
        self.where, self.d, self.names = where, d, tuple(d)
        self.keys = [k for k, v in d.items() if not isinstance(v, Tensor) and k not in _MACHINERY]
        self.plain = frozenset(k for k in self.keys if _leaves(d[k]) is not None)
        self.values = tuple(copy.deepcopy(d[k]) if k in self.plain else d[k] for k in self.keys)
        get = operator.itemgetter(*self.keys) if self.keys else lambda d: ()
        got = self.values[0] if len(self.values) == 1 else self.values  # as ``get`` gives them
        self.quick = (d, buffers, len(d), len(buffers), get, got)

    def differs(self) -> str | None:
        """The first key added, gone or of another value, as ``where.key``; None where none
        is."""
        changed = [k for k in self.names if k not in self.d]
        changed += [k for k in self.d if k not in self.names]
        changed += [
            k
            for k, v in zip(self.keys, self.values, strict=True)
            if k in self.d and not (_equal(self.d[k], v) if k in self.plain else self.d[k] is v)
        ]
        return f"{self.where}.{changed[0]}" if changed else None


def _slots(kind: type) -> tuple[str, ...]:
    """The names of the ``__slots__`` that ``kind`` and the classes it derives from declare
    (private ones as Python mangles them), but ``__dict__`` and ``__weakref__``."""
    names = []
    for c in kind.__mro__:
        declared = vars(c).get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            names.append(f"_{c.__name__.lstrip('_')}{name}" if private else name)
    return tuple(names)


class _Live:
    """An object's slots, or a container's entries, as a dict (``now``) that ``read`` fills
    again from ``items`` (name, value pairs): compared as an object's ``__dict__`` is."""

    def __init__(self, items: Callable[[], Iterable[tuple[object, object]]]):
        self.items, self.now = items, {}
        self.read()

    def read(self) -> None:
        self.now.clear()
        self.now.update(self.items())


def _entries(v: object) -> Callable[[], Iterable[tuple[object, object]]] | None:
    """What a ``_Live`` reads of ``v``: its slots' values (those set), or a tuple's, list's or
    dict's entries where they are not plain values alone (those are compared by value) and
    not more than ``LEAVES``; None for anything else."""
    if type(v) in CONTAINERS:
        if len(v) > LEAVES or _leaves(v) is not None:
            return None
        return v.items if type(v) is dict else functools.partial(enumerate, v)
    names = _slots(type(v))
    if not names or isinstance(v, _OPAQUE):
        return None
    return lambda: ((n, getattr(v, n)) for n in names if hasattr(v, n))


class State:
    """The state of ``modules`` now, kept to tell whether they are in it again: each tensor
    they keep, itself and its version; then quickly, by the counts of each module's attributes
    and buffers and the values of its attributes and of those of the objects it holds, and
    theirs (one C call each), or else attribute by attribute."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = tuple(modules)
        # (name, dict, key, tensor, version): the modules' buffers and tensor attributes, and
        # the tensors of the objects and containers they hold
        self.tensors: list[tuple[str, dict, object, Tensor, int]] = []
        self.attributes: list[_Attributes] = []
        self.live: list[_Live] = []
        held: set[int] = set()  # a config many modules hold is compared once
        for m in self.modules:
            name = type(m).__name__
            self._keep(m._buffers, name)
            self._keep(vars(m), name)
            self.attributes.append(_Attributes(name, vars(m), m._buffers))
            self._hold(vars(m), name, held, DEPTH)
        self._quick = [a.quick for a in self.attributes]
        self.running = Running(self.modules)

    def _keep(self, d: dict, where: str) -> None:
        self.tensors += [
            (f"{where}.{k}", d, k, t, _version(t)) for k, t in d.items() if isinstance(t, Tensor)
        ]

    def _hold(self, d: dict, where: str, held: set[int], depth: int) -> None:
        """The attributes of the objects the values of ``d`` are (a slotted one's slots), and
        the entries of its tuples, lists and dicts that hold more than plain values, and
        theirs, ``depth`` levels in."""
        for k, v in d.items():
            if id(v) in held or k in _OWN or type(v) in PLAIN or isinstance(v, Tensor):
                continue
            entries = _entries(v)
            if entries is not None:
                self.live.append(_Live(entries))
                found = self.live[-1].now
            elif hasattr(v, "__dict__") and not isinstance(v, _OPAQUE):
                found = vars(v)
            else:
                continue
            held.add(id(v))
            self._keep(found, f"{where}.{k}")
            self.attributes.append(_Attributes(f"{where}.{k}", found))
            if depth > 1:
                self._hold(found, f"{where}.{k}", held, depth - 1)

    def differs(self) -> str | None:
        """None where the modules are in this state again; else the first attribute that
        differs, as ``Class.name`` (``Class.held.name`` for an object's it holds, and so on)."""
        for live in self.live:
            live.read()
        for name, where, k, t, version in self.tensors:
            if where.get(k) is not t or _version(t) != version:
                return name
        running = self.running.differs()
        if running is not None:
            return running
        try:
            if all(
                len(d) == n and len(b) == nb and get(d) == got
                for d, b, n, nb, get, got in self._quick
            ):
                return None
        except Exception:  # noqa: BLE001 - an attribute gone, or one no plain value compares to
            pass
        return self._named()

    def _named(self) -> str | None:
        """The first attribute that differs, looked for one by one: a tensor the state did not
        keep, or an entry added, gone, or of another value."""
        kept = {(id(where), k) for _, where, k, _, _ in self.tensors}
        for m in self.modules:
            for where in (m._buffers, vars(m)):
                for k, t in where.items():
                    if isinstance(t, Tensor) and (id(where), k) not in kept:
                        return f"{type(m).__name__}.{k}"
        return next((d for a in self.attributes if (d := a.differs()) is not None), None)
