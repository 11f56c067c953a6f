"""Raw parameters in broadcast elementwise ops: ``x + pos_embed``, ``gamma * x`` (LayerScale),
``cls_token.expand(B, -1, -1)``. Exact per-example gradients from the forward as it runs.

While the model runs, a torch function mode watches every op that takes one of the watched
parameters. In an elementwise op whose result has the batch on dimension 0 and takes the
parameter broadcast along it, the parameter is replaced by a view of it expanded to the batch
(zero-stride: no copy), which leaves every value as it was; ``p.expand(B, ...)`` is such a view
already. Row i of that view is what example i reads, so the gradient at the view, summed over
the other dimensions the parameter was broadcast along, is example i's gradient. Any other use
of the parameter (a matmul, an index, a dtype cast...) is recorded, and the parameter goes to
the fallback with the op's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from ..rules import Dense
from .owners import batch_owner, combine, is_batch, reduce
from .plan import ParamPlan
from .trace import RowTrace

# ops whose result broadcasts its tensor arguments elementwise; in-place ones only when the
# parameter is not the tensor edited
ELEMENTWISE = {
    *("add", "sub", "mul", "div", "true_divide", "rsub"),
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__"),
    *("__truediv__", "__rtruediv__", "__iadd__", "__isub__", "__imul__", "__itruediv__"),
    *("add_", "sub_", "mul_", "div_"),
}
EXPAND = {"expand", "expand_as"}
READS = {"__get__", "size", "dim", "numel", "ndimension", "nelement"}  # metadata, not a use


@dataclass(eq=False)
class View:
    """A batch-expanded view of a parameter: row i is what example i reads."""

    param: ParamPlan
    edge: GradientEdge
    shape: torch.Size  # (B, *aligned shape of the parameter)
    aligned: torch.Size  # the parameter's shape with leading 1s to the view's rank
    reached: bool = False  # its gradient arrived in the backward


@dataclass
class Uses:
    views: list[View] = field(default_factory=list)
    other: str | None = None  # the first op that used the parameter some other way


def _name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


class BroadcastTap(TorchFunctionMode):
    """The mode that watches ``params`` during one forward of a batch of ``batch`` examples."""

    def __init__(self, params: Sequence[ParamPlan], batch: int, trace: RowTrace):
        super().__init__()
        self.batch, self.trace = batch, trace
        self.watched = {id(p.param): p for p in params}
        self.uses: dict[str, Uses] = {p.name: Uses() for p in params}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._on_grad: Callable[[View, Tensor], None] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = self._watched_in(args, kwargs)
        name = _name(func)
        if not found or name in READS:
            return func(*args, **kwargs)
        if len(found) == 1 and found[0][0] is not None:
            served = self._served(name, *found[0], func, args, kwargs)
            if served is not None:
                return served
        for _, p in found:  # a use no view can follow
            self.uses[p.name].other = self.uses[p.name].other or name
        return func(*args, **kwargs)

    def _watched_in(self, args: tuple, kwargs: dict) -> list[tuple[int | None, ParamPlan]]:
        """(position among args, or None when nested or by keyword; the parameter), per use."""
        found = [(i, self.watched[id(a)]) for i, a in enumerate(args) if id(a) in self.watched]
        rest = [a for a in args if isinstance(a, (list, tuple))] + list(kwargs.values())
        for a in rest:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if id(t) in self.watched:
                    found.append((None, self.watched[id(t)]))
        return found

    def _served(self, name: str, i: int, p: ParamPlan, func, args, kwargs) -> Tensor | None:
        """The op's result with the parameter read through a batch view, or None."""
        if name in EXPAND and i == 0:
            out = func(*args, **kwargs)
            return self._view(p, out) if self._batched(p.param, out.shape) else None
        if name not in ELEMENTWISE or (name.endswith("_") and i == 0):
            return None
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
        if not self._batched(p.param, shape):
            return None
        if not self._rows_are_examples(args, len(shape)):
            self.uses[p.name].other = self.uses[p.name].other or f"{name} on rows not the examples"
            return None
        aligned = p.param.reshape((1,) * (len(shape) - p.param.dim()) + tuple(p.param.shape))
        view = self._view(p, aligned.expand(self.batch, *aligned.shape[1:]))
        return func(*args[:i], view, *args[i + 1 :], **kwargs)

    def _batched(self, param: Tensor, shape: torch.Size) -> bool:
        """Whether a result of ``shape`` has the batch on dimension 0 and takes ``param``
        broadcast along it."""
        if len(shape) == 0 or shape[0] != self.batch or param.dim() > len(shape):
            return False
        return param.dim() < len(shape) or param.shape[0] == 1

    def _rows_are_examples(self, args: tuple, rank: int) -> bool:
        """Whether row i of the op's result is example i's alone, by the other operands' owners."""
        owners = [self.trace.owner(a) for a in args if isinstance(a, Tensor)]
        o = reduce(combine(*owners), range(1, rank)) if owners else None
        return o is not None and o.dim() == rank and is_batch(o, self.batch)

    def _view(self, p: ParamPlan, view: Tensor) -> Tensor:
        aligned = torch.Size((1,) * (view.dim() - p.param.dim()) + tuple(p.param.shape))
        entry = View(p, torch.autograd.graph.get_gradient_edge(view), view.shape, aligned)
        self.uses[p.name].views.append(entry)
        self._hooks.append(view.register_hook(functools.partial(self._read, entry)))
        # row i is what example i reads: the trace follows where each row goes from here
        self.trace.owners[view] = batch_owner(self.batch, view.dim(), view.device)
        return view

    def _read(self, view: View, grad: Tensor) -> None:
        if self._on_grad is not None:
            self._on_grad(view, grad)

    # -- after the forward -------------------------------------------------------------------

    def views(self) -> list[View]:
        return [v for uses in self.uses.values() for v in uses.views]

    def reading(self, on_grad: Callable[[View, Tensor], None] | None) -> None:
        """Hand each view's gradient to ``on_grad`` from now on (None: stop, and drop the hooks)."""
        self._on_grad = on_grad
        if on_grad is None:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()


def per_example(view: View, grad: Tensor) -> Dense:
    """Example i's gradient from the gradient at row i of the view."""
    dims = [d for d in range(1, grad.dim()) if view.aligned[d] == 1 and grad.shape[d] > 1]
    summed = grad.sum(dims, keepdim=True) if dims else grad
    return Dense(summed.reshape(grad.shape[0], *view.param.param.shape))
