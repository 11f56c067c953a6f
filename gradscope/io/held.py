"""Objects a Python caller holds (a model, a DataLoader, a dict of tensors), named in a config
by a spec of their own so that a run reads them where it would read a file: ``data.path``,
``--ref`` and ``model.factory`` may be ``<DataLoader at 0x7f...>`` while the API's call runs."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_HELD: dict[str, Any] = {}
# whether a held module stands in a run's key by its weights: not in a run no other resumes
_BY_WEIGHTS: ContextVar[bool] = ContextVar("by_weights", default=True)


def is_held(spec: object) -> bool:
    """Whether ``spec`` names an object held for the running call."""
    return isinstance(spec, str) and spec in _HELD


def held(spec: str) -> Any:
    return _HELD[spec]


@contextlib.contextmanager
def holding(obj: Any) -> Iterator[str]:
    """``obj``'s spec, which names it for as long as the block runs; a module's weights and
    buffers as they were when it ends (a run that scored it in another dtype or on another
    device converted them: the caller's model is left as it was)."""
    spec = f"<{type(obj).__name__} at {id(obj):#x}>"
    mine = spec not in _HELD
    _HELD[spec] = obj
    kept = _tensors(obj) if mine else []
    try:
        yield spec
    finally:
        if mine:
            del _HELD[spec]
            _restore(kept)


def _tensors(obj: Any) -> list[tuple[Any, str, Any, Any, Any]]:
    """(module, name, the object held there, its tensor, its gradient) of every parameter and
    buffer of a module; none for anything else."""
    import torch

    if not isinstance(obj, torch.nn.Module):
        return []
    kept = []
    for module in obj.modules():
        for name, p in module._parameters.items():
            if p is not None:  # a conversion changes a gradient in place (grad.data = ...)
                kept.append((module, name, p, p.data, None if p.grad is None else p.grad.data))
        for name, b in module._buffers.items():
            if b is not None:
                kept.append((module, name, b, b, None))
    return kept


def _restore(kept: list[tuple[Any, str, Any, Any, Any]]) -> None:
    """Each parameter's tensor and gradient, each buffer, as ``_tensors`` kept them, where a
    conversion (``Module.to``) replaced them."""
    import torch

    with torch.no_grad():
        for module, name, held_there, tensor, grad in kept:
            if not isinstance(held_there, torch.nn.Parameter):
                if module._buffers.get(name) is not held_there:
                    module._buffers[name] = held_there
            elif (
                held_there.data.data_ptr() != tensor.data_ptr() or held_there.dtype != tensor.dtype
            ):
                held_there.grad = None  # of the converted dtype: it would not fit the weight
                held_there.data = tensor
                if grad is not None:
                    held_there.grad = grad


@contextlib.contextmanager
def unresumed() -> Iterator[None]:
    """Runs inside key a held module by its spec, not its weights' sha256 (seconds for a
    model of billions of parameters): for a run written to a call's temporary folder, which
    no run resumes and nothing reads after the call."""
    token = _BY_WEIGHTS.set(False)
    try:
        yield
    finally:
        _BY_WEIGHTS.reset(token)


def identity(spec: str) -> str:
    """What stands for a held object in a run's key instead of its address (which a new object
    may take, and the same object keeps while its weights change): a module by its class and
    the sha256 of its parameters and buffers (by its spec inside ``unresumed``); rows by their
    type (they are keyed by their own sha256, ``io.data.code_rows_sha256``); a function (a
    loss) by its spec, its address."""
    import torch

    from .files import hash_tensor

    obj = _HELD[spec]
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        return spec  # a loss or output function: by its address, as before (two lambdas alike)
    if not isinstance(obj, torch.nn.Module):
        return f"<{type(obj).__name__}>"
    if not _BY_WEIGHTS.get():
        return spec
    h = hashlib.sha256()
    for name, t in obj.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or torch.nn.parameter.is_lazy(t):  # extra state
            h.update(f"{name} {type(t).__name__};".encode())  # or a lazy module's, unmade
            continue
        hash_tensor(h, name, t, end=";")
    return f"<{type(obj).__name__} {h.hexdigest()}>"


def unaddressed(value: Any) -> Any:
    """``value`` (a run's key: JSON's dicts, lists and strings) with every held object's spec
    replaced by its ``identity``."""
    if isinstance(value, dict):
        return {k: unaddressed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [unaddressed(v) for v in value]
    return identity(value) if is_held(value) else value
