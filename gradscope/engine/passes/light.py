"""Light regions: a region call (``analysis/regions.py``) whose only need is the tap's reads of
whole parameters by ``F.linear``, ``F.embedding`` or ``x @ W`` on rows laid out by shapes alone
(one row per example, or ``Lanes``): ``nn.MultiheadAttention``'s projections, read inside
``F.multi_head_attention_forward`` on sequence-first rows. The analysed batch keeps each such
read as a ``Recipe``; a replayed batch runs the call under ``LightRegion``, a torch function
mode that passes every op through but the reads of the watched parameters, which it serves by
their recipes: no trace, no owners, no tap.

The witness of a light region call: its reads in the analysed order, each the same function on
an input of the same shape with the same parameters, after as many autograd nodes since the call
began as the analysed batch made; as many nodes over the whole call; as many outputs. Any other
call is ``Diverged`` and analysed in full.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ...rules import Contribution, Dense
from ...rules.embedding import lookup
from ...rules.linear import affine_parts
from ..capture import Capture, ReadHooks, Use, counter, edge, read_at
from ..plan import Plan
from ..rows import Lanes, Rows, regroup


@dataclass(frozen=True)
class Recipe:
    """One read of whole parameters by a function: ``op`` (linear, embedding, or a product
    ``x @ W``), the parameters at its roles ((role, name): weight, bias), its input's shape,
    the layout of its rows (None: one row per example on dimension 0, or, for ``grouped_mm``,
    rows a routed region follows: ``routed.py``), the autograd nodes made from the region call's
    start to the read's end, whether a grouped product reads W itself ((E, in, out)), not its
    transpose, and whether a linear one reads one expert's matrix of a 3-D W."""

    op: str
    roles: tuple[tuple[str, str], ...]
    shape: tuple[int, ...]
    rows: Lanes | None
    at: int = 0
    transposed: bool = False
    expert: bool = False  # ``F.linear`` of ``W[e]``, a 3-D W's matrix that a value picks

    @property
    def kind(self) -> tuple:
        """What an open routed region matches a read by: the function, the parameters, the
        view of them (``passes/routed.py``)."""
        return self.op, self.roles, self.transposed, self.expert

    def parts(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, args: tuple, kwargs: dict, batch: int
    ) -> Callable[[Tensor], dict[str, Contribution]]:
        """The read's contributions by parameter name from its output gradient."""
        names = dict(self.roles)
        by_role = read_parts(self.op, x.detach(), weight, bias, self.rows, args, kwargs, batch)
        return lambda grad: {names[r]: part for r, part in by_role(grad).items() if r in names}


def read_parts(
    op: str,
    a: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: Rows | None,
    args: tuple,
    kwargs: dict,
    batch: int,
) -> Callable[[Tensor], dict[str, Contribution]]:
    """output gradient -> {role (weight, bias): its contribution} of one read of ``weight``
    (and ``bias``) by ``op`` on the rows of ``a`` (``rows``: their layout, None where one per
    example on dimension 0): the tap's reads and the light regions' recipes alike."""
    shape = weight.shape

    def parts(grad: Tensor) -> dict[str, Contribution]:
        (xs, g), counts = (a, grad), None
        if rows is not None:
            (xs, g), counts = regroup(rows, batch, a, grad)
        if op == "embedding":
            padding = kwargs.get("padding_idx", args[2] if len(args) > 2 else None)
            by_freq = kwargs.get("scale_grad_by_freq", args[5] if len(args) > 5 else False)
            got = {"weight": lookup(xs, g, shape[0], padding, by_freq)}
        else:
            transposed = op != "linear"  # x @ W: W is (in, out)
            got = affine_parts(xs, g, weight, bias, transposed, counts)
        return got

    return parts


def broadcast_parts(
    shape: torch.Size, view: torch.Size, batch: int, rows: Tensor | None = None
) -> Callable[[Tensor], Dense]:
    """output gradient at a view of a parameter of ``shape`` broadcast to ``view`` along its
    dimension 0 (and others where it has size 1) -> each example's gradient: the gradient at
    its rows (row r example r's, or ``rows[r]``'s), summed where the view repeats it."""
    aligned = torch.Size((1,) * (len(view) - len(shape)) + tuple(shape))

    def parts(grad: Tensor) -> Dense:
        dims = [k for k in range(1, grad.dim()) if aligned[k] == 1 and grad.shape[k] > 1]
        summed = grad.sum(dims, keepdim=True) if dims else grad
        per_row = summed.reshape(grad.shape[0], *shape)
        if rows is not None:
            per_row = per_row.new_zeros(batch, *shape).index_add_(0, rows, per_row)
        return Dense(per_row)

    return parts


def broadcast_view(param: Tensor, shape: torch.Size) -> Tensor:
    """``param`` aligned to a result of ``shape`` and expanded along its dimension 0."""
    aligned = param.reshape((1,) * (len(shape) - param.dim()) + tuple(param.shape))
    return aligned.expand(shape[0], *aligned.shape[1:])


def bind_affine(op: str, args: tuple, kwargs: dict) -> tuple | None:
    """(input, weight, bias) of a linear, embedding or product call, or None."""
    if op == "linear":
        x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return x, weight, bias
    if op == "embedding":
        return args[0], args[1] if len(args) > 1 else kwargs.get("weight"), None
    if op == "__rmatmul__":  # W.__rmatmul__(x) is x @ W
        args = (args[1], args[0])
    if len(args) == 2 and isinstance(args[1], Tensor) and args[1].dim() == 2:
        return args[0], args[1], None
    return None


class LightRegion(TorchFunctionMode):
    """One light region call of a replayed batch: ``recipes`` its reads, ``during`` the autograd
    nodes the analysed call made; entered at once, left by ``finish`` (or ``close``)."""

    def __init__(self, plan: Plan, recipes: Sequence[Recipe], during: int | None, batch: int):
        super().__init__()
        self.recipes, self.during, self.batch = tuple(recipes), during, batch
        self.params = {name: plan.find(name) for r in self.recipes for _, name in r.roles}
        self.watched = {id(p.param) for p in self.params.values()}
        self.session = Capture(())  # no hooked module inside: the replay's hooks find none
        self.uses: list[Use] = []
        self.hooks = ReadHooks()
        self.why: str | None = None
        self._next = 0
        self._start = counter()
        self._open = True
        self.__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(id(a) in self.watched for a in (*args, *kwargs.values())) or _metadata(func):
            return func(*args, **kwargs)
        if func in OPENED:
            with self:  # its projections come to this mode one by one
                return OPENED[func](*args, **kwargs)
        recipe = self.recipes[self._next] if self._next < len(self.recipes) else None
        if recipe is not None and _name(func) == recipe.op:
            self._next += 1
            if recipe.roles[0][0].startswith(ARG):
                return self._broadcast(recipe, func, args, kwargs)
            return self._read(recipe, func, args, kwargs)
        out = func(*args, **kwargs)
        if not (isinstance(out, Tensor) and id(out) in self.watched):  # W.to(its own dtype): W
            self.why = self.why or f"another read than the analysed batch's ({_name(func)})"
        return out

    def _read(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        call = bind_affine(recipe.op, args, kwargs)
        if call is None or not self._matches(recipe, *call):
            self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.during is not None and counter() - self._start != recipe.at:
            self.why = self.why or "other operations before a read than the analysed batch's"
        x, weight, bias = call
        if isinstance(out, Tensor) and out.requires_grad:
            parts = recipe.parts(x, weight, bias, args, kwargs, self.batch)
            target, viewed = read_at(out, tree_flatten((args, kwargs))[0])
            if viewed is not None:
                parts = viewed_parts(parts, viewed)
            params = tuple(self.params[name] for _, name in recipe.roles)
            with torch._C.DisableTorchFunction():
                use = Use(params, edge(target), parts)
                self.hooks.add(target, use)
            self.uses.append(use)
        return out

    def _broadcast(self, recipe: Recipe, func, args: tuple, kwargs: dict):
        """A parameter broadcast along the result's rows, row r example r's: by an elementwise
        op, or ``p.expand(B, ...)`` (``analysis/broadcasts.py``)."""
        ((role, name),) = recipe.roles
        i, p = int(role[len(ARG) :]), self.params[name]
        expand = recipe.op in EXPAND
        if len(args) > i and args[i] is p.param:
            if expand:
                view = func(*args, **kwargs)
                shape = view.shape
            else:
                shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, Tensor)))
                view = broadcast_view(p.param, shape) if tuple(shape) == recipe.shape else None
            at = recipe.at if self.during is None else counter() - self._start
            if view is not None and tuple(shape) == recipe.shape and at == recipe.at:
                per_row = broadcast_parts(p.param.shape, view.shape, self.batch)
                with torch._C.DisableTorchFunction():
                    use = Use((p,), edge(view), lambda grad: {name: per_row(grad)})
                    self.hooks.add(view, use)
                self.uses.append(use)
                return view if expand else func(*args[:i], view, *args[i + 1 :], **kwargs)
            if expand:
                self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
                return view
        self.why = self.why or f"another read than the analysed batch's ({recipe.op})"
        return func(*args, **kwargs)

    def _matches(self, recipe: Recipe, x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
        roles = dict(recipe.roles)
        given = {"weight": weight, "bias": bias}
        return (
            isinstance(x, Tensor)
            and tuple(x.shape) == recipe.shape
            and all(given.get(role) is self.params[name].param for role, name in roles.items())
            and all(t is None or id(t) not in self.watched or r in roles for r, t in given.items())
        )

    # -- as the replay and the backward ask a region ----------------------------------------

    def enter(self, module: nn.Module, args: tuple) -> None:
        """A hooked module's call inside the region, which the analysed batch's made none of."""
        self.why = self.why or f"other operations than the analysed batch's (a {_kind(module)})"

    def captured(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        pass

    def close(self) -> None:
        if self._open:
            self._open = False
            self.__exit__(None, None, None)

    def finish(self, outputs: Sequence[Tensor], exit: tuple) -> str | None:
        """The call's end: why the batch is not one the analysis describes, or None."""
        self.close()
        if self.why:
            return self.why
        if self._next != len(self.recipes):
            return "fewer reads than the analysed batch's"
        if len(outputs) != len(exit) or counter() - self._start != self.during:
            return "other operations than the analysed batch's"
        return None

    def calls(self) -> list:
        return []

    def pending(self) -> Tensor | None:
        """What the replay must read on the host at the forward's end: none here."""
        return None

    def reads(self) -> list[Use]:
        return list(self.uses)

    def reading(self, on_grad: Callable | None) -> None:
        self.hooks.reading(on_grad)


class RootReads(LightRegion):
    """The reads of a replayed batch outside every region call and every call of their
    parameters' modules (a ViT's ``cls_token`` and ``pos_embed`` at the model's top level),
    served by their recipes as a light region serves its own, in the analysed order, over the
    whole forward; ``ruled(p)``: whether a call of the module whose rule serves ``p`` is under
    way (its reads there are the rule's). The replay's witness between its events stands for
    the autograd nodes before each read."""

    def __init__(self, plan: Plan, recipes: Sequence[Recipe], batch: int, ruled: Callable):
        self.ruled = ruled
        super().__init__(plan, recipes, None, batch)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = {id(a) for a in (*args, *kwargs.values()) if id(a) in self.watched}
        if found and any(self.ruled(p) for p in self.params.values() if id(p.param) in found):
            return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)

    def finish_reads(self) -> str | None:
        """The forward's end: why the batch's reads are not the analysed ones, or None."""
        self.close()
        if self.why:
            return self.why
        return "fewer reads than the analysed batch's" if self._next != len(self.recipes) else None


def in_order(reads: list[Use]) -> list[Use]:
    """Reads in the order the forward made them (their gradients' nodes were made then)."""
    return sorted(reads, key=lambda u: u.edge.node._sequence_nr())


def viewed_parts(parts: Callable, viewed: Callable) -> Callable:
    """``parts`` of a read whose output is a view of the tensor its gradient arrives at."""
    return lambda grad: parts(viewed(grad))


def _kind(module: nn.Module) -> str:
    return type(module).__name__


def _name(func) -> str:
    return getattr(func, "__name__", "")


def _metadata(func) -> bool:
    """Whether ``func`` asks a tensor what it is (its shape, dtype, ...) without reading it."""
    name = _name(func)
    if name == "__get__":  # a property: its name, unless it is a view (W.T)
        return _name(getattr(func, "__self__", None)) not in ("T", "mT", "H", "mH")
    return name in METADATA


ARG = "arg"  # a broadcast recipe's role: the position of the parameter among the op's arguments
EXPAND = {"expand", "expand_as"}

# what a watched tensor may be asked without being read
METADATA = {"__get__", "size", "dim", "numel", "ndimension", "nelement", "shape", "dtype"}
METADATA |= {"device", "requires_grad", "is_floating_point", "data_ptr", "__len__"}
METADATA |= {"_has_compatible_shallow_copy_type"}


def opened(func: Callable) -> Callable:
    """A copy of a function written over torch ops that skips its own hand-over to the torch
    function modes, so that a mode sees each op inside it (``nn.MultiheadAttention``'s
    projections are ``F.linear`` calls inside ``F.multi_head_attention_forward``)."""
    scope = {**func.__globals__, "has_torch_function": lambda *_: False}
    copy = types.FunctionType(
        func.__code__, scope, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


# the functions the tap and the light regions open: each function -> its opened copy
OPENED = {F.multi_head_attention_forward: opened(F.multi_head_attention_forward)}
