"""The op vocabulary: the sets of op names the analysis (the trace, the tap), the replay (the
light and routed regions, the row flow) and the shared modules know, each name one meaning, and
how an op is named (``op_name``). The dispatch tables by op (``analysis/lanes/``,
``analysis/contractions.py``) and the functions the tap serves (``analysis/functions.py``) are
their modules' own."""

from __future__ import annotations

from collections.abc import Callable

import torch


def op_name(func: Callable) -> str:
    """The op's name; a property's (``x.T``) rather than ``__get__``."""
    short = _NAMES.get(func)
    if short is not None:
        return short
    name = getattr(func, "__name__", None)
    if name == "__get__":  # a new method-wrapper on every read, none of torch's: not kept
        return getattr(getattr(func, "__self__", None), "__name__", name)
    name = _replaced(func) or name or str(func)
    short = _NAMES[func] = name.split("::")[-1].split(".")[0]  # torch.ops.lib.name.overload
    return short


def _replaced(func: Callable) -> str | None:
    """The name of the host read (``ESCAPES``, ``SIZED_BY_VALUES``) that ``func`` now is, where
    something replaced torch's own after import (a wrapper of ``Tensor.__bool__`` that counts
    its calls, under whatever name of its own): a read the analysis must see as that read, or
    a branch on it would go unwitnessed."""
    for name in ESCAPES | SIZED_BY_VALUES:
        if func is getattr(torch.Tensor, name, None) or func is _TORCH.get(name):
            return name
    return None


def scalar_reads() -> frozenset[Callable]:
    """The functions of SCALAR_READS as a function mode is handed them now (methods, and
    ``torch.equal``'s kind), replaced ones included."""
    return frozenset(
        f
        for name in SCALAR_READS
        for f in (getattr(torch.Tensor, name, None), _TORCH.get(name))
        if f
    )


# torch's own names, read without its module ``__getattr__``, which most of these names miss
# after a search of its lazy submodules and an exception (a region call asks for ten)
_TORCH = vars(torch)


# func -> its name, asked for once per op by the trace and the tap: torch's functions and
# methods, a set fixed by the library
_NAMES: dict[Callable, str] = {}

# -- what a tensor is, and its values read on the host

# what a watched tensor may be asked without being read
METADATA = {"__get__", "size", "dim", "numel", "ndimension", "nelement", "shape", "dtype"}
METADATA |= {"device", "requires_grad", "is_floating_point", "data_ptr", "__len__"}
METADATA |= {"_has_compatible_shallow_copy_type"}
# what the trace runs without following: what a tensor is, and its values read once ESCAPES
# has seen them
UNFOLLOWED = {"__get__", "size", "dim", "numel", "ndimension", "nelement", "item", "tolist"}
UNFOLLOWED |= {"data_ptr", "element_size", "is_floating_point", "is_complex", "__len__", "stride"}
UNFOLLOWED |= {
    "__bool__",
    "__index__",
    "__int__",
    "__float__",
    "__format__",
    "__repr__",
    "__hash__",
}
# the reads of one Python scalar from tensors' values on the host, by op: a light region call's
# witness compares them batch to batch (``RegionCall.hosts``)
SCALAR_READS = frozenset({"__bool__", "item", "__int__", "__index__", "__float__", "__complex__"})
SCALAR_READS |= {"equal", "allclose", "is_nonzero", "__contains__"}
# reads of a tensor's values back to the host, where the model's Python may branch on them
ESCAPES = SCALAR_READS | {"tolist", "numpy", "__array__"}
# ops whose result's shape depends on its argument's values: read back to the host too
SIZED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
SIZED_BY_VALUES |= {"bincount", "nonzero_static"}

# -- elementwise
# the trace's: each output element from the elements at its position (broadcast)
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
    "requires_grad_",  # the tensor itself, flagged (transformers' enable_input_require_grads)
}
# the row flow's: each output row from the rows at its position
ROW_WISE = {"add", "sub", "mul", "div", "true_divide", "neg", "pow", "exp", "log", "sqrt"}
ROW_WISE |= {"rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "softplus", "where", "clamp"}
ROW_WISE |= {"masked_fill", "float", "double", "half", "bfloat16", "contiguous", "clone"}
ROW_WISE |= {"detach", "dropout", "to", "type_as", "__add__", "__radd__", "__sub__", "__rsub__"}
ROW_WISE |= {"__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__neg__", "__pow__"}
ROW_WISE |= {"add_", "mul_", "div_", "sub_", "__iadd__", "__imul__", "__isub__", "__itruediv__"}
ROW_WISE |= {"clamp_min", "clamp_max", "erf", "abs", "__floordiv__", "floor_divide", "__mod__"}
ROW_WISE |= {"remainder", "long", "int", "bool", "eq", "ne", "lt", "gt", "le", "ge", "__eq__"}
ROW_WISE |= {"__ne__", "__lt__", "__gt__", "__le__", "__ge__", "logical_and", "logical_or"}
ROW_WISE |= {"square", "relu6", "leaky_relu", "elu", "selu", "celu", "mish", "hardswish"}
ROW_WISE |= {"hardsigmoid", "hardtanh", "log_sigmoid", "softsign", "reciprocal", "sign"}
ROW_WISE |= {"sin", "cos", "log1p", "expm1", "nan_to_num", "relu_", "silu_", "gelu_"}
ROW_WISE |= {"requires_grad_"}
# the tap's: ops whose result broadcasts its tensor arguments elementwise; in-place ones only
# when the parameter is not the tensor edited
BROADCASTING = {
    *("add", "sub", "mul", "div", "true_divide", "rsub"),
    *("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__"),
    *("__truediv__", "__rtruediv__", "__iadd__", "__isub__", "__imul__", "__itruediv__"),
    *("add_", "sub_", "mul_", "div_", "maximum", "minimum", "where"),
    *("pow", "__pow__", "__rpow__"),
}
# casts and copies of a tensor: its values, as they are
CASTS = {"float", "double", "half", "bfloat16", "to", "type", "type_as", "contiguous", "clone"}
# casts whose tensor arguments after the first give only a dtype and device: x.to(y), x.type_as(y)
CAST_LIKE = {"to", "type_as"}
# ``x + c``, ``c - x``, ``-x``: a parameter shifted
SHIFTS = {"__add__", "__radd__", "add", "__sub__", "sub", "__rsub__", "rsub", "__neg__", "neg"}
# ``c * x``, ``x / c``: a parameter scaled
SCALES = {"__mul__", "__rmul__", "mul", "__truediv__", "div", "true_divide"}

# -- moves of elements, views
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
# reshapes: the rows split or merged as the shapes say
RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
# the row flow's: views that move dimensions, the rows' among them (``replay/moved.py``)
DIM_MOVES = {"permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "T"}
DIM_MOVES |= {"mT", "unsqueeze", "squeeze"}
# views whose place in the parameter is known: the index of a basic view, a 2-D transpose
VIEWS = {"__getitem__", "select", "narrow", "chunk", "split", "unbind", "t", "T", "mT"}
VIEWS |= {"transpose"}
# views of a watched 3-D parameter a routed region follows: W^T, W[e]
EXPERT_VIEWS = {"transpose", "swapaxes", "mT", "__getitem__"}
# a parameter spread along the batch by a view (``p.expand(B, ...)``), or a copy too (SPREAD)
EXPAND = {"expand", "expand_as"}
SPREAD = EXPAND | {"repeat"}  # a parameter spread along the batch by a view or a copy
# tensors joined along a dimension
JOINS = {"cat", "concat", "concatenate", "stack"}
# a tensor split along a dimension, or one slice of it
SPLITS = {"chunk", "split", "tensor_split", "split_with_sizes", "unbind", "narrow", "select"}
# elements taken or put along a dimension by an index of the same rank
ALONG = {"gather", "take_along_dim", "scatter", "scatter_", "scatter_add", "scatter_add_"}
SORTS = {"sort", "argsort"}  # a permutation along a dimension: owners move with the values
INDICES = {"where", "nonzero", "argwhere"}  # with one argument: positions of true elements
# ops that move elements to places that their tensor arguments' values pick: the result's
# owners hold for those values only (``follow.OwnerAlgebra.by_values``)
PICKED = {"__getitem__", "index_select", "gather", "take_along_dim", "take", "masked_select"}
PICKED |= {"repeat_interleave", "__setitem__", "index_put", "index_put_", "index_copy"}
PICKED |= {"index_copy_", "index_fill", "index_fill_"}
# x's elements or rows where a mask or an index puts source's: in place or not
PLACES = {"masked_scatter", "masked_scatter_", "index_add", "index_add_", "index_copy"}
PLACES |= {"index_copy_"}
# x.scatter*(dim, index, src): rows of src land at index; in place or not
SCATTERS = {"scatter", "scatter_add", "scatter_reduce", "scatter_", "scatter_add_"}
SCATTERS |= {"scatter_reduce_"}

# -- writes in place (besides the ops whose name ends in one ``_``)
# Python's in-place operators and ``x[i] = y``: ops that write their first argument
WRITES_IN_PLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}
WRITES_IN_PLACE |= {"__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
# writes in place that put values where they land: their owners move with them
IN_PLACE_MOVES = {"__setitem__", "copy_", "masked_fill_", "fill_", "zero_"}
# ``x += y``, ...: x's elements combined with y's at their position
ELEMENTWISE_IN_PLACE = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}

# -- reductions
# the trace's: reductions over dims given by a ``dim`` argument (all dims when absent); shape
# kept or not
REDUCTIONS = {
    *("sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "max", "min", "argmax"),
    *("argmin", "all", "any", "std", "var", "norm", "logsumexp", "count_nonzero", "median"),
    *("softmax", "log_softmax", "cumsum", "cumprod", "sort", "argsort", "topk", "normalize"),
    *("cummax", "cummin", "std_mean", "var_mean", "aminmax", "logcumsumexp"),
}
# reductions whose result keeps the input's shape
KEEPS_SHAPE = {"softmax", "log_softmax", "cumsum", "cumprod", "sort", "argsort", "normalize"}
KEEPS_SHAPE |= {"cummax", "cummin", "logcumsumexp", "topk"}
# the row flow's: reductions that keep the rows where they reduce another dimension than 0
ROW_REDUCTIONS = {"sum", "mean", "amax", "amin", "softmax", "log_softmax", "topk", "max", "min"}
ROW_REDUCTIONS |= {"cumsum", "prod", "norm", "logsumexp", "sort", "argmax", "argmin"}

# -- new tensors, positions
# the trace's: new tensors shaped like their input, whose values come from no example;
# arange's and zeros' tensor arguments are counts (torch.arange(n) for a 0-dim n; an RNN's
# initial state sized by a packed sequence's batch_sizes[0]), through which nothing flows back
CREATIONS = {"new_ones", "new_zeros", "new_full", "new_empty", "new_tensor", "zeros_like"}
CREATIONS |= {"ones_like", "empty_like", "full_like", "arange", "zeros", "ones", "empty"}
# the row flow's: ops whose results depend on no example, whatever their arguments
FILLS = {"zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones"}
FILLS |= {"new_empty", "new_full", "arange", "zeros", "ones", "empty", "full"}
# ops whose results are positions, not values: nothing of an example flows through them
POSITIONS = {"argsort", "nonzero", "argwhere"}

# -- products
# row by row products with a weight: ``F.linear``, grouped GEMMs
PRODUCTS = {"linear", "grouped_mm", "_grouped_mm"}
# matrix products: row by row where the right operand is a matrix
MATMULS = {"matmul", "__matmul__", "mm"}
# grouped GEMMs of fused expert weights
GROUPED = {"grouped_mm", "_grouped_mm", "grouped_mm_fallback"}  # torch's, transformers'
# reads of one expert's matrix ``W[e]`` of a 3-D W (``Recipe.expert``): ``F.linear(x, W[e])``,
# and ``x @ W[e]`` where W is (E, in, out)
EXPERT_READS = {"linear", "matmul", "__matmul__"}
# additions of an expert's bias to its rows
BIASED = {"add", "__add__", "__radd__"}  # and ``x + b[e]``, one row of a 2-D b (GPT-OSS's)

# -- packed sequences and bags
# the recurrent kernels (``_VF.lstm``: on a packed sequence's data, its batch sizes second)
RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}
# ops whose rows the row flow follows by slot or bag (``replay/packrows.py``)
SLOTTED = RECURRENT | {"_pack_padded_sequence", "_pad_packed_sequence", "embedding_bag"}
