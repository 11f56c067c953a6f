"""Raw parameters where functions read them: exact per-example gradients from the forward as it runs.

A parameter held by a module without a rule (a Linear subclass with its own forward, a scaled
embedding, a router's weight read by ``F.linear``, a fused 3-D expert weight, a ViT's
``cls_token``, a LayerScale ``gamma``) is watched by a torch function mode while the model runs:

- views of it (``W[e]``, ``W[:, :k]``, ``W.chunk(3)``, ``W.T``, ``W.float()``, ``1 + w``, ``-w``)
  are followed, each with its ``Place`` in the parameter;
- ``F.linear(x, W)``, ``x @ W`` and ``F.embedding(ids, W)`` on it or a view are served by the
  Linear and Embedding math, on rows traced to their examples (``trace.py``);
- in an elementwise op whose result has the batch on dimension 0 and takes it broadcast along
  it, the parameter is replaced by a view of it expanded to the batch (zero-stride, no copy):
  row i of that view is what example i reads, so the gradient there, summed over the other
  dimensions it was broadcast along, is example i's gradient; ``p.expand(B, ...)`` is such a
  view already.

Any other use (a matmul of two parameters, a dtype-changing view, an index it cannot place, rows
that mix examples) is recorded, and the parameter goes to the fallback with the op's name.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from ..rules import Contribution, Dense
from ..rules.embedding import lookup
from ..rules.linear import affine_parts
from ..rules.placed import Place, Placed
from .ops import op_name
from .owners import NONE, combine, is_batch, reduce, regroup, rows_or_none
from .plan import ParamPlan
from .trace import ByTensor, RowTrace
from .views import CASTS, SCALES, SHIFTS, VIEWS, compose, places

# ops whose result broadcasts its tensor arguments elementwise; in-place ones only when the
# parameter is not the tensor edited
ELEMENTWISE = {
    *("add", "sub", "mul", "div", "true_divide", "rsub"),
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__"),
    *("__truediv__", "__rtruediv__", "__iadd__", "__isub__", "__imul__", "__itruediv__"),
    *("add_", "sub_", "mul_", "div_"),
}
EXPAND = {"expand", "expand_as"}
READS = {"__get__", "size", "dim", "numel", "ndimension", "nelement", "shape", "dtype"}
READS |= {"device", "requires_grad", "is_floating_point", "data_ptr", "__len__"}


@dataclass(frozen=True)
class Derived:
    """A tensor read from a watched parameter, at ``place``."""

    param: ParamPlan
    place: Place = Place()


@dataclass(eq=False)
class Use:
    """One read the rules serve: where its output's gradient arrives, and what it gives then."""

    params: tuple[ParamPlan, ...]
    edge: GradientEdge
    parts: Callable[[Tensor], dict[str, Contribution]]  # output gradient -> {name: part}
    reached: bool = False  # its gradient arrived in the backward
    requested: bool = False  # the backward requests its gradient: nothing below needs it


@dataclass
class Uses:
    reads: list[Use] = field(default_factory=list)
    other: str | None = None  # the first op that used the parameter some other way


class ParamTap(TorchFunctionMode):
    """The mode that watches ``params`` during one forward of a batch of ``batch`` examples."""

    def __init__(
        self,
        params: Sequence[ParamPlan],
        batch: int,
        trace: RowTrace,
        ruled: Callable[[ParamPlan], bool] = lambda p: False,
        expand: bool = False,
        assume: bool = False,
    ):
        super().__init__()
        self.batch, self.trace = batch, trace
        self.ruled = ruled  # whether a parameter's reads are, for now, its module rule's
        # as HookSession's: rows shared by the batch expanded to it, and B rows computed from no
        # example taken as the examples', each while the engine's checks confirm it
        self.expand, self.assume = expand, assume
        self.expanded = self.assumed = False
        self.derived = ByTensor()
        for p in params:
            self.derived[p.param] = Derived(p)
        self.uses: dict[str, Uses] = {p.name: Uses() for p in params}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._on_grad: Callable[[Use, Tensor], None] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name in READS or (func.__name__ == "__get__" and name not in VIEWS):
            return func(*args, **kwargs)  # metadata: asked before any lookup
        found = self._watched_in(args, kwargs)
        if not found:
            return func(*args, **kwargs)
        if name in OPEN:
            with self:  # the function's own ops come to this mode, one by one
                return _opened(func)(*args, **kwargs)
        served = self._served(name, found, func, args, kwargs)
        if served is not None:
            return served
        for _, d in found:  # a use no rule can follow
            self.uses[d.param.name].other = self.uses[d.param.name].other or name
        return func(*args, **kwargs)

    def _watched_in(self, args: tuple, kwargs: dict) -> list[tuple[int | None, Derived]]:
        """(position among args, or None when nested or by keyword; what it reads), per use; none
        of a parameter whose module's rule serves its reads now (a call of that module runs)."""
        found: list = self.derived.found_in(args)
        rest = [a for a in args if isinstance(a, (list, tuple))] + list(kwargs.values())
        nested = [t for a in rest for t in (a if isinstance(a, (list, tuple)) else (a,))]
        if nested:
            found += [(None, d) for _, d in self.derived.found_in(nested)]
        return [(i, d) for i, d in found if not self.ruled(d.param)]

    def _served(self, name: str, found: list, func, args: tuple, kwargs: dict) -> object:
        """The op's result, with what it reads of the watched parameters recorded; or None."""
        if name in ("linear", "embedding", "matmul", "__matmul__", "__rmatmul__"):
            return self._function(name, func, args, kwargs)
        if name in GROUPED:
            return self._grouped(func, args, kwargs)
        if len(found) != 1 or found[0][0] is None:
            return None
        i, d = found[0]
        if i == 0 and (name in CASTS or name in VIEWS):
            return self._derive(name, d, func, args, kwargs)
        if name in SHIFTS | SCALES and not any(
            isinstance(a, Tensor) for a in args if a is not args[i]
        ):
            return self._derive(name, d, func, args, kwargs)
        return self._broadcast(name, i, d, func, args, kwargs)

    # -- views of a parameter ---------------------------------------------------------------

    def _derive(self, name: str, d: Derived, func, args: tuple, kwargs: dict) -> object:
        out = func(*args, **kwargs)
        where = places(name, d.place, args, kwargs, d.param.param, out)
        if where is None:
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, place in zip(outs, where, strict=True):
            self.derived[t] = Derived(d.param, place)
        return out

    # -- functions the Linear and Embedding math serve --------------------------------------

    def _function(self, name: str, func, args: tuple, kwargs: dict) -> Tensor | None:
        call = _bind(name, args, kwargs)
        if call is None:
            return None
        x, weight, bias = call
        reads = [(role, self._watched(t)) for role, t in (("weight", weight), ("bias", bias))]
        reads = [(role, d) for role, d in reads if d is not None]
        if not reads or self._watched(x) is not None:
            return None
        features = 0 if name == "embedding" else 1
        if self.expand and name in ("linear", "embedding") and self._shared(x):
            shared = x.unsqueeze(0) if x.dim() == 1 else x
            x = shared.expand(self.batch, *shared.shape[1:])
            args = (x, *args[1:])
            self.expanded = True
        rows = self._rows(x, features)
        if rows is False:
            for _, d in reads:
                self.uses[d.param.name].other = self.uses[d.param.name].other or (
                    f"{name} on rows that mix examples"
                )
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if rows is ASSUMED:
            rows = None
            self.trace.owners[out] = self.trace.standard(out.dim())
        if not out.requires_grad:
            return out
        a = x.detach()
        shape = weight.shape

        def parts(grad: Tensor) -> dict[str, Contribution]:
            xs, g = a, grad
            if rows is not None:
                xs = regroup(a, rows, self.batch, a.dim() - rows.dim())
                g = regroup(grad, rows, self.batch, grad.dim() - rows.dim())
            if name == "embedding":
                padding = kwargs.get("padding_idx", args[2] if len(args) > 2 else None)
                by_freq = kwargs.get("scale_grad_by_freq", args[5] if len(args) > 5 else False)
                got = {"weight": lookup(xs, g, shape[0], padding, by_freq)}
            else:
                transposed = name != "linear"  # x @ W: W is (in, out)
                got = affine_parts(xs, g, weight, bias, transposed)
            return {d.param.name: _place(got[role], d) for role, d in reads if role in got}

        self._use(tuple(d.param for _, d in reads), out, parts)
        return out

    def _grouped(self, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``grouped_mm(x, W, offs)``: rows offs[e-1]:offs[e] of x times W[e], the experts of a
        fused 3-D weight run on their sorted tokens: a Linear per expert, placed at W[e]."""
        x, weight = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        extra = [v for k, v in kwargs.items() if k != "offs" and v is not None]
        if len(args) > 3 or extra or self._watched(x) is not None or offs is None or x.dim() != 2:
            return None
        d = self._watched(weight)
        if d is None or weight.dim() != 3 or (d.place.index and d.place.transposed):
            return None
        rows = self._rows(x, 1)
        if rows is False or rows is ASSUMED:
            return None
        out = func(*args, **kwargs)
        if not out.requires_grad:
            return out
        owner = torch.arange(self.batch, device=x.device) if rows is None else rows  # (S,)
        a, ends = x.detach(), offs.tolist()

        def parts(grad: Tensor) -> dict[str, Contribution]:
            blocks, start = [], 0
            for e, end in enumerate(ends):
                if end > start:
                    rows_e = owner[start:end]
                    xs = regroup(a[start:end], rows_e, self.batch, 1)
                    g = regroup(grad[start:end], rows_e, self.batch, 1)
                    part = affine_parts(xs, g, weight[e], None, transposed=True)["weight"]
                    index = (e,) if not d.place.index else compose(d.place.index, (e,), 3)
                    place = Place(index, d.place.transposed, d.place.scale)
                    blocks.append(Placed(part, d.param.param.shape, place))
                start = end
            if not blocks:
                return {}
            merged = blocks[0]
            for block in blocks[1:]:
                merged = merged.merge(block)
            return {d.param.name: merged}

        self._use((d.param,), out, parts)
        return out

    def _watched(self, t: object) -> Derived | None:
        """What ``t`` reads of a watched parameter, unless its module's rule serves it now."""
        d = self.derived.get(t) if isinstance(t, Tensor) else None
        return None if d is None or self.ruled(d.param) else d

    def _shared(self, x: Tensor) -> bool:
        """Rows computed from no example, one set for the whole batch: a (1, ...) tensor or 1-D
        indices (``wpe(arange(T))``), as HookSession expands for module calls."""
        if (
            not isinstance(x, Tensor)
            or x.dim() == 0
            or not bool((self.trace.owner(x) == NONE).all())
        ):
            return False
        if x.dim() == 1:
            return not (x.is_floating_point() or x.is_complex())
        return x.shape[0] == 1

    def _rows(self, x: Tensor, features: int) -> Tensor | None | bool | object:
        """None: one row per example on dimension 0; a tensor: each row's example, for the rows
        to be gathered; ASSUMED: B rows computed (wholly or in part) from no example, taken as
        the examples' (see HookSession); False: rows that mix examples or that the batch shares."""
        if x.dim() <= features:
            return False
        if self.trace.one_row_each(x, self.trace.owner(x), features):
            return None
        o = reduce(self.trace.owner(x), range(x.dim() - features, x.dim()), keepdim=False)
        o = o.expand(x.shape[: x.dim() - features])  # owners may be compact (one example)
        if x.numel() == 0:
            return torch.zeros(x.shape[: x.dim() - features], dtype=torch.long, device=x.device)
        if is_batch(o.reshape(o.shape[0], -1), self.batch):
            return None
        if bool((o >= 0).all()):
            return o
        if self.assume and x.shape[0] == self.batch and rows_or_none(o, self.batch):
            self.assumed = True
            return ASSUMED
        return False

    # -- broadcasts ---------------------------------------------------------------------------

    def _broadcast(self, name: str, i: int, d: Derived, func, args, kwargs) -> Tensor | None:
        """The op's result with the parameter read through a batch view, or None."""
        source = args[i]
        if name in EXPAND and i == 0:
            out = func(*args, **kwargs)
            return self._view(d, source, out) if self._batched(source, out.shape) else None
        if name not in ELEMENTWISE or (name.endswith("_") and i == 0):
            return None
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
        if not self._batched(source, shape):
            return None
        if not self._rows_are_examples(args, len(shape)):
            uses = self.uses[d.param.name]
            uses.other = uses.other or f"{name} on rows not the examples"
            return None
        aligned = source.reshape((1,) * (len(shape) - source.dim()) + tuple(source.shape))
        view = self._view(d, source, aligned.expand(self.batch, *aligned.shape[1:]))
        return func(*args[:i], view, *args[i + 1 :], **kwargs)

    def _batched(self, source: Tensor, shape: torch.Size) -> bool:
        """Whether a result of ``shape`` has the batch on dimension 0 and takes ``source``
        broadcast along it."""
        if len(shape) == 0 or shape[0] != self.batch or source.dim() > len(shape):
            return False
        return source.dim() < len(shape) or source.shape[0] == 1

    def _rows_are_examples(self, args: tuple, rank: int) -> bool:
        """Whether row i of the op's result is example i's alone, by the other operands' owners."""
        owners = [self.trace.owner(a) for a in args if isinstance(a, Tensor)]
        o = reduce(combine(*owners), range(1, rank)) if owners else None
        return o is not None and o.dim() == rank and is_batch(o, self.batch)

    def _view(self, d: Derived, source: Tensor, view: Tensor) -> Tensor:
        aligned = torch.Size((1,) * (view.dim() - source.dim()) + tuple(source.shape))

        def parts(grad: Tensor) -> dict[str, Contribution]:
            """Example i's gradient from the gradient at row i of the view."""
            dims = [k for k in range(1, grad.dim()) if aligned[k] == 1 and grad.shape[k] > 1]
            summed = grad.sum(dims, keepdim=True) if dims else grad
            return {d.param.name: _place(Dense(summed.reshape(grad.shape[0], *source.shape)), d)}

        self._use((d.param,), view, parts)
        # row i is what example i reads: the trace follows where each row goes from here
        self.trace.owners[view] = self.trace.standard(view.dim())
        return view

    # -- the backward --------------------------------------------------------------------------

    def _use(self, params: tuple[ParamPlan, ...], out: Tensor, parts) -> None:
        with torch._C.DisableTorchFunction():  # the trace below need not see this
            use = Use(params, torch.autograd.graph.get_gradient_edge(out), parts)
            self._hooks.append(out.register_hook(functools.partial(self._read, use)))
        for p in params:
            self.uses[p.name].reads.append(use)

    def _read(self, use: Use, grad: Tensor) -> Tensor | None:
        if self._on_grad is None:
            return None
        self._on_grad(use, grad)
        # a requested read's gradient goes nowhere after this: keep no copy of it
        return grad.new_zeros(()).expand_as(grad) if use.requested else None

    def reads(self) -> list[Use]:
        """Every read the rules serve, once each."""
        return list({id(u): u for uses in self.uses.values() for u in uses.reads}.values())

    def reading(self, on_grad: Callable[[Use, Tensor], None] | None) -> None:
        """Hand each read's gradient to ``on_grad`` from now on (None: stop, drop the hooks)."""
        self._on_grad = on_grad
        if on_grad is None:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()


def _place(part: Contribution, d: Derived) -> Contribution:
    """``part`` where ``d`` sits in its parameter (as it is, for the whole parameter)."""
    if d.place == Place():
        return part
    return Placed(part, d.param.param.shape, d.place)


def _bind(name: str, args: tuple, kwargs: dict) -> tuple | None:
    """(input, weight, bias) of a linear, matmul or embedding call, or None."""
    if name == "linear":
        x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return x, weight, bias
    if name == "embedding":
        return args[0], args[1] if len(args) > 1 else kwargs.get("weight"), None
    if name == "__rmatmul__":  # W.__rmatmul__(x) is x @ W
        args = (args[1], args[0])
    if len(args) == 2 and isinstance(args[1], Tensor) and args[1].dim() == 2:
        return args[0], args[1], None
    return None


@functools.cache
def _opened(func: Callable) -> Callable:
    """A copy of ``func`` that skips its own hand-over to the torch function modes: run under
    the tap, each op inside it (the projections' ``linear``) comes to the tap by itself."""
    scope = {**func.__globals__, "has_torch_function": lambda *_: False}
    opened = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
    )
    opened.__kwdefaults__ = func.__kwdefaults__
    return opened


# functions written in Python over torch ops, opened so that the tap sees the ops inside:
# nn.MultiheadAttention's projections are F.linear calls within it
OPEN = {"multi_head_attention_forward"}
ASSUMED = object()  # rows taken as the examples' until the losses' owners say otherwise
# grouped GEMMs of fused expert weights: torch's, and transformers' fallback op
GROUPED = {"grouped_mm", "_grouped_mm", "grouped_mm_fallback"}
