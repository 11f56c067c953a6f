"""The hooks a pass leaves on the model and its tensors, and who they hand what they see to:
the hooked modules' (``ModuleHooks``), registered once while an Engine is entered and lent to
each pass's session (``capture.Capture``); the tensor hooks on the captured calls' outputs and
on the outputs of the tap's and the regions' reads (``ReadHooks``), which hand each output
gradient on as the backward reaches it, all added and removed as ``GradHooks``. What they hand
on to is named here by what they ask of it (``Session``, ``Read``), so that this module
imports none of the engine's."""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn


def own_hook(fn: Callable) -> Callable:
    """Marks ``fn`` as one of gradscope's module hooks (an ``Engine``'s, registered anew on each
    ``with``): not the model's, which ``theirs`` gives."""
    fn.gradscope_own = True  # type: ignore[attr-defined]
    return fn


def theirs(hooks: dict) -> tuple:
    """The hooks of one dict of a module's (or torch's global ones) that are the model's or
    the user's, not gradscope's own (``own_hook``)."""
    return tuple(
        h for h in hooks.values() if not getattr(getattr(h, "__func__", h), "gradscope_own", False)
    )


class Session(Protocol):
    """What the module hooks hand each call to: a pass's session (``capture.Capture``)."""

    modules: Sequence[nn.Module]

    def _enter(self, module: nn.Module, args: tuple) -> tuple | None: ...

    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None: ...


class Read(Protocol):
    """What the read hooks hand each gradient on with: a read (``capture.Use``)."""

    requested: bool  # the backward requests its gradient: keep no copy of it


class ModuleHooks:
    """The hooks of the hooked modules, registered once while an ``Engine`` is entered and lent
    to each pass's session in turn (``Capture``): registering and removing two hooks on each
    module on every batch costs a pass ~5 us a module. Outside a pass they do nothing. The
    session sees a call's input given by keyword in its place (``placed``)."""

    def __init__(self):
        self.session: Session | None = None
        self._modules: tuple[nn.Module, ...] | None = None  # the modules hooked, while open
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._depth = 0  # an Engine may be entered again inside its own ``with``

    def open(self, modules: Sequence[nn.Module]) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._modules = tuple(modules)
        for module in modules:
            pre = module.register_forward_pre_hook(self._enter, with_kwargs=True)
            self._handles += [pre, module.register_forward_hook(self._captured, with_kwargs=True)]

    def close(self) -> None:
        self._depth -= 1
        if self._depth:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._modules, self.session = None, None

    def lend(self, session: Session) -> bool:
        """Hand the hooks to ``session`` where they hook its modules and no session holds
        them; False where it must hook its modules itself (a plan whose modules changed)."""
        mine, theirs = self._modules, session.modules
        if self.session is not None or mine is None or len(mine) != len(theirs):
            return False
        if not all(map(operator.is_, mine, theirs)):  # the same modules, compared in C
            return False
        self.session = session
        return True

    @own_hook
    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        session = self.session
        if session is None:
            return None
        if kwargs:
            args, kwargs = placed(module, args, kwargs)
        new = session._enter(module, args)
        return None if new is None else (new, kwargs)  # the call's input replaced: in place

    @own_hook
    def _captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        session = self.session
        if session is not None:
            if kwargs:
                args, kwargs = placed(module, args, kwargs)
            session._captured(module, args, kwargs, output)


@functools.cache
def positional_names(cls: type[nn.Module], required: bool = False) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional parameters, after ``self`` (``required``:
    those without a default, which come first)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    return tuple(
        p.name for p in params if p.kind in kinds and not (required and p.default is not p.empty)
    )


def placed(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as the sessions read them, the call left as it is: its forward's
    required positional parameters given by keyword moved into place after the positional
    ones (``bag(input=ids, offsets=o)`` read as ``bag(ids, offsets=o)``), where the sessions
    and the rules read a call's leading tensors."""
    names = positional_names(type(module), required=True)[len(args) :]
    moved = tuple(itertools.takewhile(kwargs.__contains__, names))
    if not moved:
        return args, kwargs
    rest = {k: v for k, v in kwargs.items() if k not in moved}
    return (*args, *(kwargs[n] for n in moved)), rest


class GradHooks:
    """Hooks on the gradients of tensors a pass made, each added as ``Tensor.register_hook``
    adds it (into the tensor's ``_backward_hooks``, which its ``grad_fn`` reads for that
    output) but without a ``RemovableHandle``, on every captured call and read of every pass:
    a hook costs ~1 us instead of ~5. A subclass's (whose ``__torch_function__`` may take the
    registration) or a leaf's go through ``register_hook`` itself."""

    def __init__(self):
        self._added: list[tuple[dict, object]] = []  # (hooks dict, key) of each, until ``clear``

    def add(self, t: Tensor, hook: Callable[[Tensor], Tensor | None]) -> None:
        if type(t) is not Tensor or t.grad_fn is None:
            handle = t.register_hook(hook)
            self._added.append((handle.hooks_dict_ref(), handle.id))
            return
        hooks = t._backward_hooks
        if hooks is None:
            hooks = t._backward_hooks = OrderedDict()
            t.grad_fn._register_hook_dict(t)
        hooks[hook] = hook  # the hook its own key: no other key (torch's are ints) is it
        self._added.append((hooks, hook))

    def clear(self) -> None:
        """Remove every hook added (the backward is over)."""
        for hooks, key in self._added:
            if hooks is not None:
                hooks.pop(key, None)
        self._added.clear()


class ReadHooks:
    """The hooks that hand each read's output gradient on as the backward reaches it: ``add``
    one where a read's gradient arrives, ``reading`` says to whom (None: stop, drop them)."""

    def __init__(self):
        self._hooks = GradHooks()
        self._on_grad: Callable[[Read, Tensor], None] | None = None

    def add(self, target: Tensor, use: Read) -> None:
        self._hooks.add(target, functools.partial(self._arrived, use))

    def _arrived(self, use: Read, grad: Tensor | None) -> Tensor | None:
        if self._on_grad is None or grad is None:  # None: as in the captured calls' hooks
            return None
        self._on_grad(use, grad)
        # a requested read's gradient goes nowhere after this: keep no copy of it
        return grad.new_zeros(()).expand_as(grad) if use.requested else None

    def reading(self, on_grad: Callable[[Read, Tensor], None] | None) -> None:
        self._on_grad = on_grad
        if on_grad is None:
            self._hooks.clear()
