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
never a read left unserved. What the model keeps in its modules of a pass (a ``Read`` it sets
as an attribute, which registers it as a parameter; a ``Made`` it stores) is given back after
it (``GivenBack``): the model holds the tensors its own forward would have left it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..ops import op_name
from ..plan import ParamPlan
from ..recipes import OPENED, metadata, written_out


class _Stand:
    """What a ``Read`` and a ``Made`` share: an alias of the tensor ``held`` whose every op
    goes to ``region.intercepted``, with ``held`` in its place."""

    held: Tensor
    region: Intercepting | _Released

    def __new__(cls, real: Tensor, region: Intercepting | _Released):
        with torch._C.DisableTorchFunction():  # setting its attributes asks for its __dict__
            read = Tensor._make_subclass(cls, real.detach(), False)
            read.held, read.region = real, region
        return read

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = next(
            t.region for t in (*args, *kwargs.values(), *_nested(args)) if type(t) in _STANDS
        )
        return region.intercepted(func, args, kwargs)

    def __repr__(self) -> str:
        return repr(self.held)


class Read(_Stand, nn.Parameter):
    """A watched parameter as the model reads it. A ``Parameter``, so that a model asking
    ``isinstance`` finds what it held (and one setting it as its attribute registers it, as it
    would the parameter: ``given_back`` puts the parameter there after the pass)."""


class Made(_Stand, Tensor):
    """A tensor a region made from watched parameters, as the model holds it: not a
    ``Parameter``, as the tensor is not, so that a model setting it as its attribute keeps it
    among its plain attributes, as its own forward would (``given_back`` puts the tensor
    there after the pass); a parameter, its registration would raise, the tensor not a leaf."""


_STANDS = frozenset({Read, Made})
_HOLDING = _STANDS | {list, tuple}  # what may be or hold one


def _nested(args: tuple) -> list:
    """The tensors in the lists and tuples among ``args`` (``torch.cat([p, t])``)."""
    return [t for a in args if type(a) in (list, tuple) for t in a]


def _real(a: object) -> object:
    """``a`` with each ``Read`` or ``Made`` in it, or in a list or tuple it is, the tensor it
    holds."""
    if type(a) in _STANDS:  # not isinstance: Parameter's metaclass asks in Python
        return a.held
    if type(a) in (list, tuple) and any(type(t) in _STANDS for t in a):
        return type(a)(t.held if type(t) in _STANDS else t for t in a)
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
        param = p.param
        found = self.at.get(id(p))
        # the Read an alias of the parameter as it is now: the same tensor, storage and shape
        # (the Read's own never change: every op on it runs on the parameter)
        if found is None or found[0].held is not param or found[2] != _where(param):
            found = self.at[id(p)] = (Read(param, RELEASED), _holders(p), _where(param))
        return found[0], found[1]


class Intercepting:
    """A region whose reads are intercepted (``LightRegion`` with ``intercept``): uses its
    ``params``, ``made``, ``by_id``, ``_open``, ``_aside``, ``_source`` and
    ``__torch_function__``."""

    def hold(self, params: list[ParamPlan], intercept: Intercept) -> None:
        """Each of ``params`` held as a ``Read`` by every module holding it, until ``release``."""
        self.swapped: list[tuple[dict, str, Tensor]] = []
        self.lent: list[tuple[Read, Intercepting]] = []  # each Read, and whose it was
        self.wrapped: dict[int, Read | Made] = {}
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
        """Every module holds again what it held before ``hold``; each ``Made`` left to run its
        ops alone, as a closed region would, and forgotten: alive after the pass, the model
        kept it (``GivenBack``)."""
        for table, name, before in reversed(self.swapped):
            table[name] = before
        for read, region in reversed(self.lent):
            read.region = region
        for made in self.wrapped.values():
            if type(made) is Made:
                made.region = RELEASED
        self.swapped, self.lent, self.wrapped = [], [], {}

    def intercepted(self, func, args: tuple, kwargs: dict):
        """An op on a ``Read``: the region's, as its mode would see it, with the real tensors;
        after the region's end (a tensor the model kept), the op alone."""
        real_args = tuple(map(_real, args))
        real_kwargs = {k: _real(v) for k, v in kwargs.items()} if kwargs else kwargs
        if metadata(func) or not self._open:
            return func(*real_args, **real_kwargs)
        if func in OPENED and not self._aside(real_args, real_kwargs):
            return OPENED[func](*args, **kwargs)  # its reads come back here one by one
        run_as = written_out(op_name(func), real_args, real_kwargs, self._source)
        if (
            run_as is not None
            and torch.is_grad_enabled()
            and not self._aside(real_args, real_kwargs)
        ):
            return run_as(*args, **kwargs)  # BiT's group norm: its affine's reads come back here
        out = self.__torch_function__(func, (), real_args, real_kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(self._wrapped(t) for t in out)
        return self._wrapped(out)

    def _wrapped(self, t: object) -> object:
        """``t`` as the model must hold it: a ``Read`` where the region follows it (a view or
        tensor made from a watched parameter; ``Made``), else itself."""
        if isinstance(t, Tensor) and (id(t) in self.made or id(t) in self.by_id):
            return self._read_of(t)
        return t

    def _read_of(self, t: Tensor) -> Read | Made:
        read = self.wrapped.get(id(t))
        if read is None:
            kind = Read if id(t) in self.by_id else Made
            read = self.wrapped[id(t)] = kind(t, self)
            if kind is Made:
                _MADE.append(weakref.ref(read))
        return read


_MADE: list[weakref.ref] = []  # each ``Made`` the regions made since the last pass's end


class GivenBack:
    """Over a replayed pass: what the model kept of it in its modules' parameters, buffers and
    attributes as it held it then (a ``Read`` set as an attribute, so registered as a parameter
    as the parameter itself would be; a ``Made`` a forward made and kept), the tensor it stands
    for after it (``given_back``), so that the model holds what its forward would have left it,
    its parameters the user's. Looked for only where one may be: a ``Read`` registered, as
    PyTorch's registration hook tells, or a ``Made`` alive after the pass (its region let it
    go; autograd keeps the real tensors), which only a reference the model kept holds (or the
    frames of a forward that raised)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = modules

    def __enter__(self) -> None:
        self.registered = False
        _MADE.clear()
        self.handle = register_module_parameter_registration_hook(self._registering)

    def _registering(self, module: nn.Module, name: str, param: Tensor) -> None:
        self.registered = self.registered or type(param) is Read

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        kept = any(made() is not None for made in _MADE)
        _MADE.clear()
        if self.registered or kept:
            given_back(self.modules)


def given_back(modules: Iterable[nn.Module]) -> None:
    """Each ``Read`` or ``Made`` in the modules' parameters, buffers and attributes, or in a
    list (in place) or tuple among those, the tensor it stands for."""
    for m in modules:
        for d in (m._parameters, m._buffers, m.__dict__):
            if _HOLDING.isdisjoint(map(type, d.values())):  # most: at C's speed
                continue
            found = [(k, v) for k, v in d.items() if type(v) in _HOLDING and _real(v) is not v]
            for k, v in found:
                if type(v) is list:
                    v[:] = _real(v)
                else:
                    d[k] = _real(v)


def _where(param: Tensor) -> tuple[int, torch.Size]:
    """Where ``param``'s data begins, and its shape: as its Read was made, while it aliases it."""
    return param.data_ptr(), param.shape


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
