"""Recipes: how a read of parameters that the analysed batch served is served again on a later
batch without the trace (``light.py``, ``routed.py``): the function, the parameters at its
roles, its input's shape and rows, and the math each kind of read gives its contributions by
(``read_parts`` for ``F.linear``/``F.embedding``/``x @ W``, ``broadcast_parts`` for a parameter
broadcast along the rows); and what a watched parameter may be asked without being read."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ...rules import Contribution, Dense
from ...rules.conv import weight_part
from ...rules.embedding import lookup
from ...rules.linear import affine_parts
from ..derived import Computed, Derived
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
    # the roles that take a tensor made from their parameters (a view, a cast, ``exp(a)``, a
    # weight-norm weight: ``light.py`` makes it again), not a parameter itself
    computed: tuple[str, ...] = ()
    left: bool = False  # ``W @ x``: a 2-D W on the left of a batch x of (B, in, L) (Mamba's)
    expand: bool = False  # its input, no example's, expanded to the batch (a position table's)
    # a broadcast each element of whose result one example owns, or none (a CLIP-like (B, B)
    # similarity): which elements some example owns, and the slot of each (``element_parts``)
    elements: tuple[Tensor, Tensor] | None = field(default=None, compare=False)

    @property
    def kind(self) -> tuple:
        """What an open routed region matches a read by: the function, the parameters, the
        view of them (``passes/routed.py``)."""
        return self.op, self.roles, self.transposed, self.expert

    def names(self, role: str) -> tuple[str, ...]:
        """The parameters at ``role``: one, or those its tensor is made from."""
        return tuple(name for r, name in self.roles if r == role)


def recipe_roles(reads: Iterable[tuple[str, object]], given: dict) -> tuple[tuple, tuple] | None:
    """The roles of a read, and which of them are computed (``Recipe.computed``), where each
    takes a whole parameter, a view or cast of one, or a tensor made from parameters and
    constants alone (``Computed.pure``); None for any other. ``given``: the tensor at each
    role."""
    roles: list[tuple[str, str]] = []
    computed: list[str] = []
    for role, d in reads:
        if isinstance(d, Derived) and given[role] is d.param.param:
            roles.append((role, d.param.name))
        elif isinstance(d, Derived) or (isinstance(d, Computed) and d.pure):
            roles += [(role, p.name) for p in d.params]
            computed.append(role)
        else:
            return None
    return tuple(roles), tuple(computed)


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


def element_parts(
    mine: Tensor, slot: Tensor, batch: int, shape: torch.Size
) -> Callable[[Tensor], Dense]:
    """output gradient at a view of a tensor of ``shape`` broadcast element by element ->
    each example's gradient of it: the gradient at the elements it owns (``mine``), each
    summed into its ``slot`` (example, element of the tensor it broadcasts from). An element
    of several examples or of none that gets a gradient fails the read (the losses mix)."""

    def parts(grad: Tensor) -> Dense:
        g = grad.reshape(-1)
        if bool(g[~mine].ne(0).any()):
            raise ValueError("an element of several examples or none reaches the loss")
        per = g.new_zeros(batch * shape.numel()).index_add_(0, slot, g[mine])
        return Dense(per.view(batch, *shape))

    return parts


def lane_rows(lanes: Lanes, n: int, batch: int, device: torch.device | None) -> Tensor:
    """The example of each of ``n`` rows along dimension 0 laid out as ``lanes``: row r is
    example (r // m) % B (Swin's windows folded into the batch)."""
    return torch.arange(n, device=device) // lanes.m % batch


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


def left_part(a: Tensor, grad: Tensor, weight: Tensor) -> Contribution:
    """W's contribution of ``W @ a`` for a batch ``a`` of (B, in, L): ``F.linear(a.mT, W).mT``,
    by its math."""
    return affine_parts(a.mT, grad.mT, weight, None, transposed=False)["weight"]


def viewed_parts(parts: Callable, viewed: Callable) -> Callable:
    """``parts`` of a read whose output is a view of the tensor its gradient arrives at."""
    return lambda grad: parts(viewed(grad))


def name_of(func) -> str:
    """The op's name; a property's (``x.T``) rather than ``__get__``."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def metadata(func) -> bool:
    """Whether ``func`` asks a tensor what it is (its shape, dtype, ...) without reading it."""
    if getattr(func, "__name__", "") == "__get__":  # a property, unless a view (W.T)
        return name_of(func) not in ("T", "mT", "H", "mH")
    return name_of(func) in METADATA


ARG = "arg"  # a broadcast recipe's role: the position of the parameter among the op's arguments
EXPAND = {"expand", "expand_as"}
SPREAD = EXPAND | {"repeat"}  # a parameter spread along the batch by a view or a copy

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


def sdpa_math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` written out (eval mode: no dropout), so that a mask
    computed from parameters (Swin's relative position bias) is an add the tap serves."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = (q @ k.transpose(-2, -1)) * (
        scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    )
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    return scores.softmax(-1) @ v


def masked_by(args: tuple, kwargs: dict, watched: Callable) -> bool:
    """Whether an attention call without dropout takes a watched tensor as its mask."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return dropout == 0 and watched(mask) is not None


CONVS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}


@dataclass
class ConvCall:
    """``F.conv{n}d(x, weight, bias, stride, padding, dilation, groups)`` with the attributes of
    the module that would make it (what ``rules.conv.weight_part`` reads)."""

    weight: Tensor
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    _reversed_padding_repeated_twice: list[int]
    padding_mode: str = "zeros"

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0]


def bind_conv(
    name: str, args: tuple, kwargs: dict
) -> tuple[Tensor, Tensor, Tensor | None, ConvCall]:
    """(input, weight, bias, the call) of an ``F.conv{n}d`` call."""
    n = CONVS[name]
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    defaults = (None, None, None, 1, 0, 1, 1)
    given = dict(zip(names, args, strict=False)) | kwargs
    x, weight, bias, stride, padding, dilation, groups = (
        given.get(k, d) for k, d in zip(names, defaults, strict=True)
    )

    def dims(v: object) -> tuple[int, ...]:
        return tuple(v) if isinstance(v, (tuple, list)) else (int(v),) * n

    kernel, dilation = tuple(weight.shape[2:]), dims(dilation)
    if padding == "same":  # as nn.Conv pads: the odd one on the right
        totals = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)][::-1]
        pads = [p for t in totals for p in (t // 2, t - t // 2)]
    else:
        pads = [p for p in dims(0 if padding == "valid" else padding)[::-1] for _ in "lr"]
    call = ConvCall(weight, kernel, dims(stride), dilation, int(groups), pads)
    return x, weight, bias, call


def conv_parts(call: ConvCall, x: Tensor, grad: Tensor, bias: bool) -> dict[str, Contribution]:
    """The weight's (and bias's) per-example contributions of a convolution call."""
    out = {"weight": weight_part(call, x, grad)}
    if bias:
        out["bias"] = Dense(grad.flatten(2).sum(2))
    return out
