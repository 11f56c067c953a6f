"""The owners of an op's results from its inputs' owners: the ops ``trace.py`` knows by name.

Views and moves apply the same op to the owners (``MOVES``, ``RESHAPES``); elementwise ops
combine them; reductions and contractions reduce them over the dimensions they mix
(``contractions.py``: linear, matmul, conv, attention, norms, recurrent layers, grouped GEMMs).
The common case, owners that are the batch along one dimension, is ``lanes/``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..steps import SCALAR_READS

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
CAST_LIKE = {"to", "type_as"}
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
ESCAPES = SCALAR_READS | {"tolist", "numpy", "__array__"}
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


def picked_dims(key: object, pickers: list[Tensor], rank: int) -> list[int]:
    """The dimensions of a tensor of ``rank`` that ``x[key]`` indexes with one of ``pickers``
    (a bool mask of rank r indexes r dimensions; ``None`` none; ``...`` the rest)."""
    key = key if isinstance(key, tuple) else (key,)

    def width(k: object) -> int:
        if k is None or k is Ellipsis:
            return 0
        if isinstance(k, Tensor) and k.dtype == torch.bool:
            return k.dim()
        return 1

    rest = rank - sum(width(k) for k in key)
    dims, at = [], 0
    for k in key:
        span = rest if k is Ellipsis else width(k)
        if any(k is t for t in pickers):
            dims.extend(range(at, at + span))
        at += span
    return dims
