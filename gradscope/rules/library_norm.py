"""Norm layers of model libraries: HF's RMSNorms (Llama, Mistral, Qwen2, T5's ``T5LayerNorm``),
timm's ``LayerNorm`` and ``LayerNorm2d``, nanoGPT-style ``LayerNorm``: any class whose forward is
``weight * xhat + bias`` for some normalisation ``xhat`` of its input, recognised by name and
structure, never imported.

xhat comes from the module's own forward, run with bias 0 at weight 1 and at weight 0: the
difference is xhat for ``weight * xhat`` and for Gemma's ``(1 + weight) * xhat`` alike (both
runs scale xhat by a power of two, so it is exact), and it is what the class computes (HF's
float32 upcast and cast back, T5's half-precision cast, timm's permutes), whatever its eps is
called. A class that uses its weight otherwise is recognised wrongly; the engine's first-batch
self-check then moves it to the fallback.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref

import torch
from torch import Tensor, nn

from .base import Contribution
from .norm import affine, per_channel
from .registry import register_rule


def looks_like_norm(module: nn.Module) -> bool:
    """A leaf named like a LayerNorm or RMSNorm, or with HF's ``variance_epsilon``, holding a
    ``weight`` and optionally a ``bias`` of the same shape and nothing else, whose forward takes
    one input (a gated norm's ``forward(x, gate)`` scales by the gate too: the tap serves it)."""
    name = type(module).__name__.lower()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    return (
        ("layernorm" in name or "rmsnorm" in name or hasattr(module, "variance_epsilon"))
        and _one_input(type(module))
        and isinstance(weight, nn.Parameter)
        and (bias is None or (isinstance(bias, nn.Parameter) and bias.shape == weight.shape))
        and {n for n, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}
        and next(module.children(), None) is None
        and _affine_in_weight(module)
    )


def _affine_in_weight(module: nn.Module) -> bool:
    """Whether the forward is ``weight * xhat`` or ``(1 + weight) * xhat`` (plus bias), tried
    once per module (``find_rule`` asks on every call of it)."""
    known = _AFFINE.get(module)
    if known is None:
        known = _AFFINE[module] = _probe(module)
    return bool(known)


# module -> what _probe found (_SCALED: affine, zero at weight 0); weak: forgotten with it
_AFFINE: weakref.WeakKeyDictionary[nn.Module, object] = weakref.WeakKeyDictionary()
_SCALED = "scaled"
_FIRST: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # found channels first by the probe


def _probe(module: nn.Module) -> bool | str:
    """``_affine_in_weight`` tried on a small random input at a random weight: a norm that
    scales its input by the weight before normalising it (Muse Spark's input-scaled RMSNorm) is
    not, and the tap serves its weight. A module that cannot run on its features last is tried
    on (B, C, L) (SqueezeBERT's LayerNorm permutes its channels last and back): where that
    holds, it is channels first. A module the probe cannot run is taken as named (the first
    batch's self-check still holds)."""
    w, first = module.weight, channels_first(module)
    try:
        return _probe_at(module, (2, w.shape[0], 3, 3) if first else (2, 3, *w.shape), first)
    except Exception:  # noqa: BLE001 - any failure of the probe: keep the name's word
        if first or w.dim() != 1:
            return True
    try:
        found = _probe_at(module, (2, w.shape[0], 3), True)
    except Exception:  # noqa: BLE001
        return True
    if found:
        _FIRST.add(module)
    return found


def _probe_at(module: nn.Module, shape: tuple[int, ...], first: bool) -> bool | str:
    """The probe on an input of ``shape``, its features on dimension 1 where ``first``."""
    w, g = module.weight, torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(w.device, w.dtype)
    r = (torch.rand(w.shape, generator=g) + 0.5).to(w.device, w.dtype)
    at_0, at_1, at_r = (_forward_at(module, x, v) for v in (0.0, 1.0, r))
    scale = r.view(-1, *(1,) * (len(shape) - 2)) if first else r
    tol = 1e-2 if w.element_size() < 4 else 1e-4
    if not torch.allclose(at_r, at_0 + scale * (at_1 - at_0), rtol=tol, atol=tol):
        return False
    return _SCALED if not at_0.any() else True  # weight * xhat: one forward finds xhat


@functools.cache
def _one_input(cls: type[nn.Module]) -> bool:
    return len(inspect.signature(cls.forward).parameters) == 2  # self, x


def channels_first(module: nn.Module) -> bool:
    """timm's ``LayerNorm2d``, ConvNeXt's ``data_format="channels_first"`` and what the probe
    found so (SqueezeBERT's): (B, C, *spatial) normalised over C; every other norm normalises
    the last dims."""
    return (
        type(module).__name__.endswith("2d")
        or getattr(module, "data_format", None) == "channels_first"
        or module in _FIRST
    )


def unit_forward(module: nn.Module, x: Tensor) -> Tensor:
    """xhat: ``module``'s own forward on ``x`` with bias 0, at weight 1 less at weight 0 (at
    weight 1 alone where the probe found the forward at weight 0 zero: ``weight * xhat``)."""
    at_1 = _forward_at(module, x, 1.0)
    return at_1 if _AFFINE.get(module) is _SCALED else at_1 - _forward_at(module, x, 0.0)


def _forward_at(module: nn.Module, x: Tensor, weight: float | Tensor) -> Tensor:
    unit = _unit(module)  # a shallow copy: the parameter dict is replaced, not edited
    w, b = module.weight, module._parameters.get("bias")
    at = weight if isinstance(weight, Tensor) else _filled(w, weight)
    # every entry kept: a bias registered as None (nn.LayerNorm(bias=False)) is read as None
    unit._parameters = {**module._parameters, "weight": at}
    if b is not None:
        unit._parameters["bias"] = _filled(b, 0.0)
    with torch.no_grad():
        return unit.forward(x)  # not unit(x): the module's hooks, the engine's own, stay out


def _unit(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` to run at other parameters, made once per module and made
    again where an attribute of the module changed since (its eps, say)."""
    unit = _UNITS.get(module)
    attrs = module.__dict__
    if unit is None or any(
        unit.__dict__.get(k) is not v for k, v in attrs.items() if k != "_parameters"
    ):
        unit = _UNITS[module] = copy.copy(module)
    return unit


@functools.lru_cache(maxsize=64)
def _constant(shape: torch.Size, dtype: torch.dtype, device: torch.device, value: float) -> Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)


def _filled(t: Tensor, value: float) -> Tensor:
    """A tensor of ``value`` shaped as ``t``, the same one every call (never written to)."""
    return _constant(t.shape, t.dtype, t.device, value)


_UNITS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


_SIMPLE = (int, float, str, bool, type(None))


def settings(module: nn.Module) -> tuple:
    """What the module's own forward may read besides its input (``Rule.alike``): its class,
    its weight's shape, whether it has a bias, what the probe found, and its public attributes
    (eps, data_format); a module with a buffer or an attribute of another kind is alike to
    itself alone."""
    public = sorted((k, v) for k, v in vars(module).items() if not k.startswith("_"))
    if module._buffers or not all(isinstance(v, _SIMPLE) for _, v in public):
        return ("itself", id(module))
    bias = module._parameters.get("bias")
    return type(module), module.weight.shape, bias is None, _AFFINE.get(module), tuple(public)


@register_rule(
    name="library_norm",
    match=looks_like_norm,
    rows=lambda module: None if channels_first(module) else module.weight.dim(),
    alike=settings,
)
def library_norm(
    module: nn.Module, inputs: tuple[Tensor, ...], grad_output: Tensor
) -> dict[str, Contribution]:
    xhat, b, shape = unit_forward(module, inputs[0]), grad_output.shape[0], module.weight.shape
    if channels_first(module):
        return affine(module, xhat, grad_output, per_channel)
    return affine(module, xhat, grad_output, lambda t: t.reshape(b, -1, *shape).sum(1))
