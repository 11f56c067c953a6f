"""The owners of a contraction's result (``CONTRACTIONS``: linear, matmul, conv, attention,
norms, pooling, recurrent layers, grouped GEMMs, einsum): the inputs' owners reduced over the
dimensions the op mixes, then combined. The engine's ``ops.py`` names the other ops the trace
knows."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...rules.embedding_bag import BAG_ARGS, bag_of
from ..ops import RECURRENT
from ..tensors import tensors_in
from .owners import NONE, combine, compact, reduce, segment_combine
from .packed import PACKED, recurrent

if TYPE_CHECKING:
    from .trace import RowTrace


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


def _embedding_bag(trace: RowTrace, ids: Tensor, weight: Tensor, *args, **kwargs) -> Tensor:
    """F.embedding_bag: each bag from its own positions' ids and weights, a (B, L) input's bags
    its rows, a 1-D input's cut by offsets: positions the batch's values pick, where the offsets
    are computed from the batch (``lengths.cumsum``), unless the batch is of one example and
    every position its own: each bag is then its own wherever the offsets cut."""
    bound = {**dict(zip(BAG_ARGS[2:], args, strict=False)), **kwargs}
    o, weights = trace.owner(ids), bound.get("per_sample_weights")
    if isinstance(weights, Tensor):
        o = combine(o, trace.owner(weights))
    table = reduce(trace.owner(weight), [0, 1]).reshape(1, 1)
    offsets = bound.get("offsets")
    if ids.dim() != 1 or not isinstance(offsets, Tensor):
        return combine(reduce(o, range(1, ids.dim())).reshape(-1, 1), table)
    bag, starts = bag_of(offsets, ids.shape[0], bool(bound.get("include_last_offset")))
    one = compact(o.expand(ids.shape))[:1]  # (1,)
    if trace.batch == 1 and one.numel() and bool((o == one).all()):  # an empty bag's too
        return combine(one.reshape(1, 1).expand(starts.shape[0], 1), table)
    if trace._of_batch(offsets):
        trace.picked("embedding_bag")
    base = torch.full(starts.shape, NONE, dtype=torch.long, device=ids.device)
    return combine(segment_combine(base, bag, o.expand(ids.shape).contiguous()).view(-1, 1), table)


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
    """Per channel, on running statistics. On the batch's own statistics (``training``, the
    fifth argument of F.batch_norm and torch.batch_norm alike: a module in training mode, or
    without running statistics) each channel's values mix over every dimension but 1: every
    example, where the batch is dimension 0, also where no parameter of the norm is scored (a
    frozen backbone's); none, where each channel is one example's (an instance norm written
    as a batch norm over ``x.view(1, B * C, H, W)``)."""
    if kwargs.get("training", args[4] if len(args) > 4 else False) and x.dim() > 1:
        return reduce(trace.owner(x), [d for d in range(x.dim()) if d != 1])
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
    dimension 0 (batch_first) or 1 of the input and output, on dimension 1 of the states; or
    a packed sequence's (``packed.py``)."""
    if isinstance(hx, Tensor) and hx.dim() == 1 and x.dim() == 2:
        return recurrent(trace, x, hx, *args)  # (data, batch_sizes, hx, ...)
    if not isinstance(args[-1], bool) or x.dim() != 3:
        return None  # an unbatched call
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
    "embedding_bag": _embedding_bag,
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
    **dict.fromkeys(RECURRENT, _recurrent),
    **PACKED,
}
