"""The owners of an op's results from its inputs' owners: the ops ``trace.py`` knows by name.

Views and moves apply the same op to the owners (``MOVES``, ``RESHAPES``); elementwise ops
combine them; reductions and contractions reduce them over the dimensions they mix
(``CONTRACTIONS``: linear, matmul, conv, attention, norms, recurrent layers, grouped GEMMs).
The common case, owners that are the batch along one dimension, is ``lanes.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .owners import combine, compact, reduce

if TYPE_CHECKING:
    from .trace import RowTrace

# ops that move, select or copy elements: the same op applied to the owners gives theirs
MOVES = {
    *("permute", "transpose", "t", "swapaxes", "swapdims", "movedim", "moveaxis", "T", "mT"),
    *("squeeze", "unsqueeze", "expand", "expand_as", "select", "narrow", "__getitem__"),
    *("index_select", "flip", "roll", "split", "chunk", "unbind", "tensor_split", "unfold"),
    *("cat", "concat", "concatenate", "stack", "masked_select", "take_along_dim", "repeat"),
    *("repeat_interleave", "split_with_sizes", "diagonal", "tril", "triu", "gather"),
}
# moves that also write zeros: a zero written is a constant (NONE), not example 0
ZEROING = {"tril", "triu"}
RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
# each output element from the elements at its position (broadcast)
ELEMENTWISE = {
    *("add", "sub", "mul", "div", "true_divide", "rsub", "neg", "pow", "exp", "log", "sqrt"),
    *("rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "mish", "softplus", "elu", "selu"),
    *("leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "relu6", "erf", "abs", "sin", "cos"),
    *("where", "clamp", "clip", "maximum", "minimum", "masked_fill", "lerp", "addcmul", "addcdiv"),
    *("reciprocal", "square", "sign", "floor", "ceil", "round", "trunc", "log1p", "expm1"),
    *("eq", "ne", "lt", "gt", "le", "ge", "logical_not", "logical_and", "logical_or", "isfinite"),
    *("isnan", "isinf", "nan_to_num", "float", "double", "half", "bfloat16", "type", "long"),
    *("int", "bool", "contiguous", "clone", "detach", "dropout", "alpha_dropout", "clamp_min"),
    *("clamp_max", "multiply", "divide", "subtract", "greater", "greater_equal", "less"),
    *("less_equal", "not_equal", "fmax", "fmin"),
    *("dropout1d", "dropout2d", "dropout3d", "feature_alpha_dropout", "log_sigmoid", "fmod"),
    *("remainder", "glu", "tanhshrink", "softsign", "threshold", "celu", "prelu", "silu_"),
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__"),
    *("__rtruediv__", "__neg__", "__pow__", "__rpow__", "__and__", "__or__", "__xor__"),
    *("__invert__", "__eq__", "__ne__", "__lt__", "__gt__", "__le__", "__ge__", "__abs__"),
    *("__floordiv__", "__mod__", "floor_divide", "bitwise_and", "bitwise_or", "bitwise_not"),
}
# reductions over dims given by a ``dim`` argument (all dims when absent); shape kept or not
REDUCTIONS = {
    *("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax"),
    *("argmin", "all", "any", "std", "var", "norm", "logsumexp", "count_nonzero", "median"),
    *("softmax", "log_softmax", "cumsum", "cumprod", "sort", "argsort", "topk", "normalize"),
    *("cummax", "cummin", "std_mean", "var_mean", "aminmax", "logcumsumexp"),
}
# casts whose tensor arguments after the first give only a dtype and device: x.to(y), x.type_as(y)
CASTS = {"to", "type_as"}
KEEPS_SHAPE = {"softmax", "log_softmax", "cumsum", "cumprod", "sort", "argsort", "normalize"}
KEEPS_SHAPE |= {"cummax", "cummin", "logcumsumexp", "topk"}
IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}
INDICES = {"where", "nonzero", "argwhere"}  # with one argument: positions of true elements
# new tensors shaped like their input, whose values come from no example; arange's tensor
# arguments are counts (torch.arange(n) for a 0-dim n), through which nothing flows back
CREATIONS = {"new_ones", "new_zeros", "new_full", "new_empty", "new_tensor", "zeros_like"}
CREATIONS |= {"ones_like", "empty_like", "full_like", "arange"}
SORTS = {"sort", "argsort"}  # a permutation along a dimension: owners move with the values
IN_PLACE_MOVES = {"__setitem__", "copy_", "masked_fill_", "fill_", "zero_"}
# x's elements or rows where a mask or an index puts source's: in place or not
PLACES = {"masked_scatter", "masked_scatter_", "index_add", "index_add_", "index_copy"}
PLACES |= {"index_copy_"}
# x.scatter*(dim, index, src): rows of src land at index; in place or not
SCATTERS = {"scatter", "scatter_add", "scatter_reduce", "scatter_", "scatter_add_"}
SCATTERS |= {"scatter_reduce_"}
# reads of a tensor's values back to the host, where the model's Python may branch on them
ESCAPES = {"__bool__", "item", "tolist", "__int__", "__index__", "__float__", "__complex__"}
ESCAPES |= {"numpy", "equal", "allclose", "__array__"}
# ops whose result's shape depends on its argument's values: read back to the host too
SIZED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
SIZED_BY_VALUES |= {"bincount", "nonzero_static"}
# ops that move elements to places that their tensor arguments' values pick: the result's
# owners hold for those values only (``follow.OwnerAlgebra.by_values``)
PICKED = {"__getitem__", "index_select", "gather", "take_along_dim", "take", "masked_select"}
PICKED |= {"repeat_interleave", "__setitem__", "index_put", "index_put_", "index_copy"}
PICKED |= {"index_copy_", "index_fill", "index_fill_"}
READS = {"__get__", "size", "dim", "numel", "ndimension", "nelement", "item", "tolist"}
READS |= {"data_ptr", "element_size", "is_floating_point", "is_complex", "__len__", "stride"}
READS |= {"__bool__", "__index__", "__int__", "__float__", "__format__", "__repr__", "__hash__"}


def op_name(func: Callable) -> str:
    """The op's name; a property's (``x.T``) rather than ``__get__``."""
    short = _NAMES.get(func)
    if short is not None:
        return short
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a new method-wrapper on every read: not kept in _NAMES
        return getattr(getattr(func, "__self__", None), "__name__", name)
    short = _NAMES[func] = name.split("::")[-1].split(".")[0]  # torch.ops.lib.name.overload
    return short


# func -> its name, asked for once per op by the trace and the tap: torch's functions and
# methods, a set fixed by the library
_NAMES: dict[Callable, str] = {}


def dims_of(name: str, args: tuple, kwargs: dict, rank: int) -> tuple[list[int], bool]:
    """(the dims an op of the REDUCTIONS set mixes, whether it keeps them)."""
    dim = kwargs.get("dim", kwargs.get("axis"))  # x.mean(axis=2): numpy's name for it
    if dim is None and len(args) > 1 and not isinstance(args[1], Tensor):
        dim = args[1]
    if name == "normalize":
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
    if name == "topk":
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    if name == "norm" and len(args) > 1:  # norm(x, p, dim)
        dim = kwargs.get("dim", kwargs.get("axis", args[2] if len(args) > 2 else None))
    if name in ("std", "var") and len(args) > 1 and isinstance(args[1], bool):  # (x, unbiased)
        dim = kwargs.get("dim", kwargs.get("axis"))
    keep = name in KEEPS_SHAPE or bool(kwargs.get("keepdim", False))
    if not keep and len(args) > 2 and isinstance(args[2], bool):
        keep = args[2]
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(rank)), keep
    return ([dim] if isinstance(dim, int) else list(dim)), keep


def binary(name: str, args: tuple, kwargs: dict) -> bool:
    """torch.max(x, y) and min: elementwise, not a reduction."""
    return name in ("max", "min") and (
        "other" in kwargs or (len(args) > 1 and isinstance(args[1], Tensor))
    )


def filled(t: Tensor, value: int) -> Tensor:
    """Owners ``value`` for every element of ``t``: (1, ..., 1) of its rank, on its device."""
    return torch.full((1,) * t.dim(), value, dtype=torch.long, device=t.device)


def tensors_in(args: tuple, kwargs: dict) -> list[Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, Tensor))
    return found


# -- contractions: output owners from the inputs' owners, reduced over what the op mixes -----


def _linear(trace: RowTrace, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    parts = [reduce(trace.owner(x), [-1]), reduce(trace.owner(weight), [-1]).reshape(1, -1)]
    if bias is not None:
        parts.append(trace.owner(bias))
    return combine(*parts)


def _grouped(trace: RowTrace, x: Tensor, weight: Tensor, *_, **__) -> Tensor:
    """grouped_mm(x, W, offs): each row of x times one expert's W."""
    return combine(
        reduce(trace.owner(x), [-1]), reduce(trace.owner(weight), range(3)).reshape(1, 1)
    )


def _matmul(trace: RowTrace, a: Tensor, b: Tensor, *_, **__) -> Tensor | None:
    """matmul and its kin (mm, bmm, mv, dot): a 1-D operand is contracted whole."""
    if a.dim() == 0 or b.dim() == 0:
        return None
    oa = reduce(trace.owner(a), [-1], keepdim=a.dim() > 1)  # (..., n, 1) or ()
    ob = reduce(trace.owner(b), [-2 if b.dim() > 1 else -1], keepdim=b.dim() > 1)  # (..., 1, m)
    if a.dim() > 1 and b.dim() == 1:
        oa = oa.squeeze(-1)  # (..., n)
    if a.dim() == 1 and b.dim() > 1:
        ob = ob.squeeze(-2)  # (..., m)
    return combine(oa, ob)


def _addmm(trace: RowTrace, bias: Tensor, *args, **kwargs) -> Tensor | None:
    """addmm(input, mat1, mat2), baddbmm(input, batch1, batch2), addmv(input, mat, vec): the
    bias (broadcast) on the product; the factors may come by keyword (Bloom's alibi.baddbmm)."""
    a, b = (*args, *(kwargs[k] for k in _FACTORS if k in kwargs))[:2]
    product = _matmul(trace, a, b)
    return None if product is None else combine(trace.owner(bias), product)


_FACTORS = ("mat1", "mat2", "batch1", "batch2", "mat", "vec")


def _addbmm(trace: RowTrace, bias: Tensor, *args, **kwargs) -> Tensor | None:
    """addbmm(input, batch1, batch2): the products of the batch of matrices summed."""
    a, b = (*args, *(kwargs[k] for k in _FACTORS if k in kwargs))[:2]
    product = _matmul(trace, a, b)
    if product is None or a.dim() != 3:
        return None
    return combine(trace.owner(bias), reduce(product, [0], keepdim=False))


def _outer(trace: RowTrace, a: Tensor, b: Tensor, *_, **__) -> Tensor:
    return combine(trace.owner(a).reshape(-1, 1), trace.owner(b).reshape(1, -1))


def _im2col(trace: RowTrace, x: Tensor, *args, **kwargs) -> Tensor:
    """F.unfold (N, C, H, W) -> (N, C*k, L): each example's patches from its own image; an
    unbatched (C, H, W) input mixes everything. Tensor.unfold (a window view) is a move."""
    if x.dim() == 4:
        return reduce(trace.owner(x), [1, 2, 3], keepdim=False).reshape(-1, 1, 1)
    return reduce(trace.owner(x), range(x.dim()), keepdim=False).reshape(1, 1)


def _conv(trace: RowTrace, x: Tensor, weight: Tensor, bias: Tensor | None = None, *_, **__):
    """Examples on dimension 0: owners constant over channels and positions."""
    o = reduce(trace.owner(x), range(1, x.dim()))
    return combine(o, reduce(trace.owner(weight), range(weight.dim())).reshape((1,) * x.dim()))


def _embedding(trace: RowTrace, ids: Tensor, weight: Tensor, *_, **__) -> Tensor:
    return combine(trace.owner(ids).unsqueeze(-1), reduce(trace.owner(weight), [0, 1]))


def _per_row(trace: RowTrace, x: Tensor, *args, **kwargs) -> Tensor:
    """A norm over the trailing dims (layer_norm, rms_norm) or all but 0 and 1 (instance)."""
    others = [reduce(trace.owner(t), range(t.dim())) for t in tensors_in(args, kwargs)]
    shape = args[0] if args else kwargs.get("normalized_shape", (x.shape[-1],))
    k = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
    o = reduce(trace.owner(x), range(x.dim() - k, x.dim()))
    return combine(o, *(t.reshape((1,) * x.dim()) for t in others))


def _whole_example(trace: RowTrace, x: Tensor, *args, **kwargs) -> Tensor:
    """Dimension 0 is the batch and every other dimension mixes (group norm, pooling...)."""
    o = reduce(trace.owner(x), range(1, x.dim()))
    others = [reduce(trace.owner(t), range(t.dim())) for t in tensors_in(args, kwargs)]
    return combine(o, *(t.reshape((1,) * x.dim()) for t in others))


def _batch_norm(trace: RowTrace, x: Tensor, *args, **kwargs) -> Tensor:
    """Per channel, on running statistics. On the batch's own statistics every example mixes;
    the batch-norm rule refuses that case with its own message, so the owners stay as they are."""
    return compact(trace.owner(x))


def _sdpa(trace: RowTrace, q: Tensor, k: Tensor, v: Tensor, attn_mask=None, *_, **kw) -> Tensor:
    parts = [reduce(trace.owner(q), [-1]), reduce(trace.owner(k), [-2, -1])]
    parts.append(reduce(trace.owner(v), [-2, -1]))
    mask = kw.get("attn_mask", attn_mask)
    if isinstance(mask, Tensor):
        parts.append(reduce(trace.owner(mask), [-1]))
    return combine(*parts)


def _mha(trace: RowTrace, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
    """F.multi_head_attention_forward: (L, N, E) inputs with examples on dimension 1, masks
    (N, S) and (N*H, L, S) by example; or one unbatched (L, E) call."""
    heads = kwargs.get("num_heads", args[1] if len(args) > 1 else 1)
    if query.dim() == 2:
        o = combine(
            *(
                reduce(trace.owner(t), range(t.dim()))
                for t in tensors_in((query, key, value, *args), kwargs)
            )
        )
        return o.reshape(1, 1), o.reshape(1, 1)
    n = query.shape[1]
    parts = [reduce(trace.owner(t), [0, 2]) for t in (query, key, value)]
    for t in tensors_in(args, kwargs):
        o = reduce(trace.owner(t), range(1, t.dim()), keepdim=False) if t.dim() else trace.owner(t)
        if t.dim() and t.shape[0] == n * heads and n * heads != n:
            o = reduce(o.expand(n * heads).reshape(n, heads), [1], keepdim=False)
        elif not t.dim() or t.shape[0] != n:
            o = reduce(o, range(o.dim()), keepdim=False)
        parts.append(o.reshape(1, -1, 1))
    o = combine(*parts)  # (1, N, 1)
    return o, o.reshape(-1, 1, 1)


def _recurrent(trace: RowTrace, x: Tensor, hx: object, *args, **__) -> tuple | None:
    """_VF.lstm / gru / rnn_tanh / rnn_relu(input, hx, params, ..., batch_first): examples on
    dimension 0 (batch_first) or 1 of the input and output, on dimension 1 of the states."""
    if not isinstance(args[-1], bool) or x.dim() != 3:
        return None  # a packed sequence, or an unbatched call
    dim = 0 if args[-1] else 1
    states = hx if isinstance(hx, (list, tuple)) else (hx,)
    parts = [reduce(trace.owner(x), [d for d in range(3) if d != dim], keepdim=False)]
    parts += [
        reduce(trace.owner(h), [0, 2], keepdim=False) for h in states if isinstance(h, Tensor)
    ]
    parts += [reduce(trace.owner(p), range(p.dim())).reshape(1) for p in tensors_in(args, {})]
    o = combine(*(p.reshape(-1) for p in parts))  # (B,) or (1,)
    out = o.reshape(-1, 1, 1) if dim == 0 else o.reshape(1, -1, 1)
    return (out, *(o.reshape(1, -1, 1) for _ in states))


def _einsum(trace: RowTrace, equation: str, *operands, **__) -> Tensor | None:
    """Each operand's owners reduced over its summed letters, laid out as the output's; an
    ellipsis stands for the same letters in every operand (right-aligned, as broadcasting)."""
    operands = (
        operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    )
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None  # the implicit output: not worth guessing
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    if "..." in equation:
        spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
        extra = [
            t.dim() - len(x) + 3 if "..." in x else 0 for x, t in zip(inputs, operands, strict=True)
        ]
        if max(extra, default=0) > len(spare) or min(extra, default=0) < 0:
            return None
        pool = "".join(spare[: max(extra, default=0)])
        inputs = [
            x.replace("...", pool[len(pool) - n :]) for x, n in zip(inputs, extra, strict=True)
        ]
        output = output.replace("...", pool)
    parts = []
    for letters, t in zip(inputs, operands, strict=True):
        o = reduce(trace.owner(t), [i for i, c in enumerate(letters) if c not in output])
        kept = [c for c in letters if c in output]
        o = o.reshape([o.shape[i] for i, c in enumerate(letters) if c in output])
        o = o.permute([kept.index(c) for c in output if c in kept])
        shape = iter(o.shape)
        parts.append(o.reshape([next(shape) if c in kept else 1 for c in output]))
    return combine(*parts)


CONTRACTIONS: dict[str, Callable[..., object]] = {
    "linear": _linear,
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "mv", "dot", "vdot"), _matmul),
    **dict.fromkeys(("addmm", "baddbmm", "addmv"), _addmm),
    "addbmm": _addbmm,
    **dict.fromkeys(("outer", "ger"), _outer),
    **dict.fromkeys(("conv1d", "conv2d", "conv3d", "conv_transpose1d"), _conv),
    **dict.fromkeys(("conv_transpose2d", "conv_transpose3d"), _conv),
    "embedding": _embedding,
    **dict.fromkeys(("grouped_mm", "_grouped_mm", "grouped_mm_fallback"), _grouped),
    **dict.fromkeys(("layer_norm", "rms_norm"), _per_row),
    **dict.fromkeys(("group_norm", "instance_norm", "local_response_norm"), _whole_example),
    **dict.fromkeys(("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d"), _whole_example),
    **dict.fromkeys(("avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d"), _whole_example),
    **dict.fromkeys(("adaptive_avg_pool2d", "adaptive_avg_pool3d", "interpolate"), _whole_example),
    **dict.fromkeys(
        ("adaptive_max_pool1d", "adaptive_max_pool2d", "pixel_shuffle"), _whole_example
    ),
    **dict.fromkeys(("max_pool2d_with_indices", "pad"), _whole_example),
    "batch_norm": _batch_norm,
    "scaled_dot_product_attention": _sdpa,
    "multi_head_attention_forward": _mha,
    "einsum": _einsum,
    "im2col": _im2col,  # F.unfold, told apart from Tensor.unfold by the function itself
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu"), _recurrent),
}
