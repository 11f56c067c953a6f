"""Reads intercepted where the parameter is read, as PyTorch's expanded weights do: while a
light region call (``light.py``) or the model's top level (``root.py``) runs, each parameter
its recipes read is held by its modules as a ``Read``, a tensor subclass that hands every op
on it to the region. Only the ops that touch a watched parameter, or a tensor the region made
from one, run any Python of the region's: the rest of the call (an attention's softmax, the
patch embedding before a class token) runs as in a plain forward, where the torch function
mode the region is otherwise saw each op.

What the mode's witness saw and this does not: scalars read on the host (none in the calls it
serves: ``light.intercepts``) and ops on constants (a recipe that reads a tensor made with
them keeps the mode: ``Recipe.constants``). A tensor made from parameters and numbers alone
(``exp(logit_scale)``, a slice of a packed weight) is made by ops on them, each seen here. A
parameter the model reaches by another way than its modules' attributes (a list it keeps) is
read unseen: the region finds fewer reads than the analysed call, its witness fails and the
batch is analysed, and the module's class keeps the mode from then on (``Record.moded``):
never a read left unserved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..plan import ParamPlan
from ..recipes import OPENED, metadata

# each function met: whether it asks a tensor what it is without reading it (``metadata``)
_ASKS: dict = {}


class Read(nn.Parameter):
    """A watched parameter (or a tensor a region made from one) as the model reads it: an
    alias of ``held`` whose every op goes to ``region.intercepted``, with ``held`` in its
    place. A ``Parameter``, so that a model asking ``isinstance`` finds what it held."""

    held: Tensor
    region: Intercepting | _Released

    def __new__(cls, real: Tensor, region: Intercepting | _Released) -> Read:
        with torch._C.DisableTorchFunction():  # setting its attributes asks for its __dict__
            read = Tensor._make_subclass(cls, real.detach(), False)
            read.held, read.region = real, region
        return read

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = next(
            t.region for t in (*args, *kwargs.values(), *_nested(args)) if type(t) is Read
        )
        return region.intercepted(func, args, kwargs)

    def __repr__(self) -> str:
        return repr(self.held)


def _nested(args: tuple) -> list:
    """The tensors in the lists and tuples among ``args`` (``torch.cat([p, t])``)."""
    return [t for a in args if type(a) in (list, tuple) for t in a]


def _real(a: object) -> object:
    """``a`` with each ``Read`` in it, or in a list or tuple it is, the tensor it holds."""
    if type(a) is Read:  # not isinstance: Parameter's metaclass asks in Python
        return a.held
    if type(a) in (list, tuple) and any(type(t) is Read for t in a):
        return type(a)(t.held if type(t) is Read else t for t in a)
    return a


class _Released:
    """The region of a kept ``Read`` between passes: an op on it (a tensor the model kept) runs
    alone, on the real tensors. Not the region that made it, which would keep that batch's
    session and tensors alive for as long as the Engine keeps its Reads."""

    @staticmethod
    def intercepted(func, args: tuple, kwargs: dict):
        return func(*map(_real, args), **{k: _real(v) for k, v in (kwargs or {}).items()})


RELEASED = _Released()


class Intercept:
    """What a region that intercepts its reads is given: where each parameter is held
    (``holders``, found once per Engine) and whom to tell where its witness fails."""

    def __init__(self, failed: Callable[[], None], holders: dict[int, tuple]):
        self.failed, self.at = failed, holders

    def holders(self, p: ParamPlan) -> tuple[Read, list]:
        """``p``'s ``Read`` and the (module, attribute) pairs whose ``_parameters`` entry holds
        it, each once: both kept for the Engine's later batches while ``p`` holds the same
        tensor (a new one, set by ``p.data = ...``, a new Read)."""
        found = self.at.get(id(p))
        if found is None or not _aliases(found[0], p.param):
            found = self.at[id(p)] = (Read(p.param, RELEASED), _holders(p))
        return found


class Intercepting:
    """A region whose reads are intercepted (``LightRegion`` with ``intercept``): uses its
    ``params``, ``made``, ``by_id``, ``_open``, ``_aside`` and ``__torch_function__``."""

    def hold(self, params: list[ParamPlan], intercept: Intercept) -> None:
        """Each of ``params`` held as a ``Read`` by every module holding it, until ``release``."""
        self.swapped: list[tuple[dict, str, Tensor]] = []
        self.lent: list[tuple[Read, Intercepting]] = []  # each Read, and whose it was
        self.wrapped: dict[int, Read] = {}
        for p in params:
            read, holders = intercept.holders(p)
            self.lent.append((read, read.region))
            read.region = self  # an outer region's too (the root's), until ``release``
            self.wrapped[id(p.param)] = read
            for module, name in holders:
                table = module._parameters
                held = table.get(name)
                if held is not p.param and not (type(held) is Read and held.held is p.param):
                    continue  # another parameter there now (a Read of an outer region's is p)
                self.swapped.append((table, name, table[name]))
                table[name] = read

    def release(self) -> None:
        """Every module holds again what it held before ``hold``."""
        for table, name, before in reversed(self.swapped):
            table[name] = before
        for read, region in reversed(self.lent):
            read.region = region
        self.swapped, self.lent = [], []

    def intercepted(self, func, args: tuple, kwargs: dict):
        """An op on a ``Read``: the region's, as its mode would see it, with the real tensors;
        after the region's end (a tensor the model kept), the op alone."""
        real_args = tuple(map(_real, args))
        real_kwargs = {k: _real(v) for k, v in kwargs.items()} if kwargs else kwargs
        asks = _ASKS.get(func)
        if asks is None:
            asks = _ASKS[func] = metadata(func)
        if asks or not self._open:
            return func(*real_args, **real_kwargs)
        if func in OPENED and not self._aside(real_args, real_kwargs):
            return OPENED[func](*args, **kwargs)  # its reads come back here one by one
        out = self.__torch_function__(func, (), real_args, real_kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(self._wrapped(t) for t in out)
        return self._wrapped(out)

    def _wrapped(self, t: object) -> object:
        """``t`` as the model must hold it: a ``Read`` where the region follows it (a view or
        tensor made from a watched parameter), else itself."""
        if isinstance(t, Tensor) and (id(t) in self.made or id(t) in self.by_id):
            return self._read_of(t)
        return t

    def _read_of(self, t: Tensor) -> Read:
        read = self.wrapped.get(id(t))
        if read is None:
            read = self.wrapped[id(t)] = Read(t, self)
        return read


def _aliases(read: Read, param: Tensor) -> bool:
    """Whether ``read`` is still an alias of ``param`` as it is now."""
    with torch._C.DisableTorchFunction():
        return (
            read.held is param
            and read.data_ptr() == param.data_ptr()
            and (read.shape == param.shape)
        )


def _holders(p: ParamPlan) -> list[tuple[nn.Module, str]]:
    """The (module, attribute) pairs whose ``_parameters`` entry holds ``p``, each once."""
    out: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    for holder, path in p.owners:
        *parents, name = path.split(".")
        module = holder
        for part in parents:
            module = getattr(module, part)
        out[(id(module), name)] = (module, name)
    return list(out.values())
