"""What runs a model's calls beside the attributes its modules hold (``state.py``): each
module's class, its children and parameters, and the hooks on it and torch's global ones, the
user's by identity (a hook swapped for another makes as many autograd nodes, so the witness
would not see it); and what an ``Engine``'s plan was made from (``made``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.modules import module as _module

from .hooks import theirs


def made(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of ``model``'s modules and parameters: what a plan made of it holds."""
    return tuple(map(id, model.modules())), tuple(map(id, model.parameters()))


# where a module keeps the hooks its calls run, and torch's global ones
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# where a module keeps its children and parameters
_HELD = ("_modules", "_parameters")
_GLOBAL_HOOKS = tuple(getattr(_module, f"_global{k}") for k in _HOOKS)


class Running:
    """What runs the calls of ``modules`` beside the attributes they hold: each one's class, its
    children and parameters (by identity), and its hooks and torch's global ones (every dict's
    count, in one C call; the model's own hooks by identity, where a dict held any)."""

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules, self.kinds = modules, list(map(type, modules))
        named = [(f"{type(m).__name__}.{k}", vars(m).get(k)) for m in modules for k in _HELD]
        self.held_names, self.held = _present(named)
        self.had = [dict(d) for d in self.held]
        named = [(f"{type(m).__name__}.{k}", vars(m).get(k)) for m in modules for k in _HOOKS]
        named += [(f"torch's global{k}", d) for k, d in zip(_HOOKS, _GLOBAL_HOOKS, strict=True)]
        self.names, self.hooks = _present(named)
        self.counts = list(map(len, self.hooks))
        self.users = [
            (n, d, t) for n, d in zip(self.names, self.hooks, strict=True) if (t := theirs(d))
        ]

    def differs(self) -> str | None:
        """The first that differs, as ``Class.__class__``, ``Class._modules``,
        ``Class._parameters`` or ``Class._forward_hooks`` (the module's class as it was); None
        where none does."""
        if list(map(type, self.modules)) != self.kinds:
            kinds = zip(self.modules, self.kinds, strict=True)
            return next(f"{k.__name__}.__class__" for m, k in kinds if type(m) is not k)
        try:  # one C call: an entry's own __eq__ runs only where it was replaced
            same = self.held == self.had
        except Exception:  # noqa: BLE001 - a replaced parameter's (a tensor's) or module's
            same = False
        if not same:
            held = zip(self.held_names, self.held, self.had, strict=True)
            return next(
                (n for n, d, h in held if d.keys() != h.keys() or any(d[k] is not h[k] for k in h)),
                "a module's children or parameters",
            )
        if list(map(len, self.hooks)) != self.counts:
            return next(
                n
                for n, d, c in zip(self.names, self.hooks, self.counts, strict=True)
                if len(d) != c
            )
        return next((n for n, d, t in self.users if theirs(d) != t), None)


def _present(named: list[tuple[str, dict | None]]) -> tuple[list[str], list[dict]]:
    """The names and dicts of ``named`` (name, a module's dict or None) that are there."""
    there = [(n, d) for n, d in named if d is not None]
    return [n for n, _ in there], [d for _, d in there]
