"""Owners known from shapes alone: the batch along one dimension, the trace's fast path.

A lane ``(dim, m)`` says that along dimension ``dim`` (of size n*B*m) element i belongs to
example (i // m) % B, and that the owners do not vary along any other dimension. Row i of a
batch tensor is (0, 1); a sequence-first (T, B, E) is (1, 1); heads folded into the batch,
(B*H, T, d), is (0, H); tokens flattened position-major, (T*B, E), is (0, 1) over T*B rows.
``after`` gives the lane of an op's result from its tracked inputs' lanes, with no tensor op,
for the ops that keep one: views and reshapes, elementwise ops, and linear, matmul, attention,
norms and reductions that leave the lane's dimension alone. None leaves the op to the owner
algebra (``owners.py``), which is exact for every op it knows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from torch import Tensor

from .ops import CASTS, ELEMENTWISE, REDUCTIONS, RESHAPES, binary, dims_of
from .owners import groups

Lane = tuple[int, int]  # (dim, m)


def after(name: str, args: tuple, kwargs: dict, lanes: dict[int, Lane], out: Tensor, batch: int):
    """The lane of ``out``, the (first) result of op ``name``, whose tracked inputs (by id) have
    ``lanes``; or None where the op may move examples across the lane or mix them."""
    if name in ELEMENTWISE or binary(name, args, kwargs):
        if name == "where" and len(args) == 1:
            return None  # positions of true elements, not values
        return _broadcast(args, kwargs, lanes, out)
    follow = _RULES.get(name)
    if follow is None or not args or not isinstance(args[0], (Tensor, list, tuple)):
        return None
    return follow(args, kwargs, lanes, out, batch)


def _broadcast(args: tuple, kwargs: dict, lanes: dict[int, Lane], out: Tensor) -> Lane | None:
    """An elementwise op: every tracked operand's lane, aligned to ``out``, the same one. Loops,
    not generators: the most frequent op."""
    found, seen = None, set()
    for t in (*args, *kwargs.values()) if kwargs else args:
        lane = lanes.get(id(t)) if isinstance(t, Tensor) else None
        if lane is None:
            continue
        j = lane[0] + out.dim() - t.dim()
        if j < 0 or out.shape[j] != t.shape[lane[0]] or (found and found != (j, lane[1])):
            return None
        found = (j, lane[1])
        seen.add(id(t))
    # a tracked tensor inside a list is not an elementwise operand
    return found if len(seen) == len(lanes) else None


def _tracked(args: tuple, kwargs: dict, lanes: dict[int, Lane]) -> list[Tensor]:
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    return [t for t in found if id(t) in lanes]


def _same(items) -> Lane | None:
    """The one lane every item has, or None (an item None, or two that differ)."""
    first = None
    for lane in items:
        if lane is None or (first is not None and lane != first):
            return None
        first = lane
    return first


def _aligned(t: Tensor, lane: Lane, out: Tensor) -> Lane | None:
    """``t``'s lane in ``out`` where ``t`` broadcasts to it (right-aligned), not along the lane."""
    j = lane[0] + out.dim() - t.dim()
    return (j, lane[1]) if 0 <= j < out.dim() and out.shape[j] == t.shape[lane[0]] else None


def _only(args: tuple, kwargs: dict, lanes: dict[int, Lane]) -> Lane | None:
    """The lane of ``args[0]`` where it is the only tracked tensor of the op."""
    if len(lanes) != 1 or id(args[0]) not in lanes:
        return None
    return lanes[id(args[0])] if len(_tracked(args, kwargs, lanes)) == 1 else None


def _dim(d: object, rank: int) -> int | None:
    return d % rank if isinstance(d, int) and not isinstance(d, bool) and rank else None


# -- views ---------------------------------------------------------------------------------


def _reshape(args, kwargs, lanes, out, batch) -> Lane | None:
    """view, reshape, flatten, unflatten, squeeze, unsqueeze: the elements in the same order,
    so the lane is where its period lands in the new shape (``reshape_lane``)."""
    lane = _only(args, kwargs, lanes)
    return None if lane is None else reshape_lane(args[0].shape, out.shape, lane, batch)


@functools.lru_cache(maxsize=4096)  # the same few reshapes in every pass of a model
def reshape_lane(shape: Sequence[int], new: Sequence[int], lane: Lane, batch: int) -> Lane | None:
    """The lane of ``t.reshape(new)`` for ``t`` of ``shape`` with ``lane``. Within the group of
    dimensions the lane's dimension is merged or split with, element f (row-major) belongs to
    example (f // P) % B, P the size of the dimensions after the lane's in the group times m:
    the lane is the new dimension j whose inner size divides P and whose size is a multiple of
    B*m' (m' = P / inner size), where that formula reads as (i_j // m') % B."""
    d, m = lane
    for i0, i1, j0, j1 in groups(shape, new) or ():
        if not i0 <= d < i1:
            continue
        period, inner = math.prod(shape[d + 1 : i1]) * m, 1
        for j in range(j1 - 1, j0 - 1, -1):
            if period % inner == 0 and new[j] % (period // inner * batch) == 0:
                return j, period // inner
            inner *= new[j]
    return None


def _swap(args, kwargs, lanes, out, batch) -> Lane | None:
    """transpose, swapaxes, swapdims."""
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    a = _dim(kwargs.get("dim0", args[1] if len(args) > 1 else None), n)
    b = _dim(kwargs.get("dim1", args[2] if len(args) > 2 else None), n)
    if lane is None or a is None or b is None:
        return None
    d = b if lane[0] == a else a if lane[0] == b else lane[0]
    return d, lane[1]


def _reversed(args, kwargs, lanes, out, batch) -> Lane | None:
    """t and T reverse the dimensions; mT swaps the last two."""
    lane = _only(args, kwargs, lanes)
    return None if lane is None else (out.dim() - 1 - lane[0], lane[1])


def _matrix_transpose(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    if lane is None or n < 2:
        return None
    d = {n - 1: n - 2, n - 2: n - 1}.get(lane[0], lane[0])
    return d, lane[1]


def _permute(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    dims = kwargs.get("dims", args[1:])
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    dims = [_dim(k, n) for k in dims]
    if lane is None or lane[0] not in dims:
        return None
    return dims.index(lane[0]), lane[1]


def _movedim(args, kwargs, lanes, out, batch) -> Lane | None:
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    src = kwargs.get("source", args[1] if len(args) > 1 else None)
    dst = kwargs.get("destination", args[2] if len(args) > 2 else None)
    src = [_dim(k, n) for k in (src if isinstance(src, (list, tuple)) else (src,))]
    dst = [_dim(k, n) for k in (dst if isinstance(dst, (list, tuple)) else (dst,))]
    if lane is None or None in src or None in dst or len(src) != len(dst):
        return None
    if lane[0] in src:
        return dst[src.index(lane[0])], lane[1]
    rest = [k for k in range(n) if k not in src]  # the others keep their order
    free = [k for k in range(n) if k not in dst]
    return free[rest.index(lane[0])], lane[1]


def _expand(args, kwargs, lanes, out, batch) -> Lane | None:
    lane = _only(args, kwargs, lanes)
    return None if lane is None else _aligned(args[0], lane, out)


def _index(args, kwargs, lanes, out, batch) -> Lane | None:
    """``x[key]`` with ints, slices, None and ``...``, that takes the lane's dimension whole."""
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    key = args[1] if len(args) > 1 else None
    key = key if isinstance(key, tuple) else (key,)
    if lane is None or not all(k is None or k is Ellipsis or _plain(k) for k in key):
        return None
    used = sum(k is not None and k is not Ellipsis for k in key)
    d, at, to = lane[0], 0, 0  # the lane's dimension; where the key is in x and in out
    for k in key:
        if k is None:
            to += 1
            continue
        span = n - used if k is Ellipsis else 1
        if at <= d < at + span:
            whole = k is Ellipsis or (
                isinstance(k, slice) and k.start is None and k.stop is None and k.step is None
            )
            return (to + d - at, lane[1]) if whole else None
        at += span
        to += 0 if isinstance(k, int) else span
    return to + d - at, lane[1]


def _plain(k: object) -> bool:
    return isinstance(k, slice) or (isinstance(k, int) and not isinstance(k, bool))


def _select(args, kwargs, lanes, out, batch) -> Lane | None:
    """select(dim, i) drops a dimension; narrow(dim, start, length) shortens it."""
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    dim = _dim(kwargs.get("dim", args[1] if len(args) > 1 else None), n)
    if lane is None or dim is None or dim == lane[0]:
        return None
    dropped = out.dim() < n and dim < lane[0]
    return lane[0] - dropped, lane[1]


def _split(args, kwargs, lanes, out, batch) -> Lane | None:
    """split, chunk, tensor_split, split_with_sizes and unbind along another dimension."""
    lane, n = _only(args, kwargs, lanes), args[0].dim()
    if out.dim() < n:  # unbind(dim)
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    else:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    dim = _dim(dim, n)
    if lane is None or dim is None or dim == lane[0]:
        return None
    return lane[0] - (out.dim() < n and dim < lane[0]), lane[1]


def _joined(args, kwargs, lanes, out, batch) -> Lane | None:
    """cat and stack of tensors all on the same lane, along another dimension."""
    parts = args[0]
    if not parts or not all(isinstance(t, Tensor) and id(t) in lanes for t in parts):
        return None
    lane = _same(lanes[id(t)] for t in parts)
    dim = _dim(kwargs.get("dim", args[1] if len(args) > 1 else 0), out.dim())
    if lane is None or dim is None or any(t.dim() != parts[0].dim() for t in parts):
        return None
    if out.dim() == parts[0].dim():  # cat
        return None if dim == lane[0] else lane
    return lane[0] + (dim <= lane[0]), lane[1]


# -- ops that mix elements along other dimensions --------------------------------------------


def _cast(args, kwargs, lanes, out, batch) -> Lane | None:
    """x.to(y), x.type_as(y): the other tensor gives a dtype only."""
    lane = lanes.get(id(args[0]))
    return lane if len(lanes) == 1 and lane is not None and out.dim() == args[0].dim() else None


def _linear(args, kwargs, lanes, out, batch) -> Lane | None:
    """linear(x, W, b) of a weight from no example, over x's last dimension."""
    lane = _only(args, kwargs, lanes)
    return lane if lane is not None and lane[0] < args[0].dim() - 1 else None


def _addmm(args, kwargs, lanes, out, batch) -> Lane | None:
    """addmm(bias, x, W) of a bias and weight from no example: x's rows (HF's Conv1D)."""
    if len(args) < 3 or len(lanes) != 1 or id(args[1]) not in lanes or kwargs:
        return None
    lane = lanes[id(args[1])]
    return lane if lane[0] == 0 else None


def _matmul(args, kwargs, lanes, out, batch) -> Lane | None:
    """a @ b: a's rows or batch dimensions; both on the lane only along batch dimensions."""
    a, b = args[0], args[1] if len(args) > 1 else None
    if not isinstance(b, Tensor) or a.dim() < 2 or b.dim() < 2:
        return None
    if len(_tracked(args, kwargs, lanes)) != (id(a) in lanes) + (id(b) in lanes):
        return None
    la, lb = lanes.get(id(a)), lanes.get(id(b))
    if la is None or la[0] == a.dim() - 1:  # b alone on the lane, or a's columns
        return None
    lane = _aligned(a, la, out)
    if lb is None:
        return lane
    if lane is None or lane[0] >= out.dim() - 2 or _aligned(b, lb, out) != lane:
        return None
    return lane


def _attention(args, kwargs, lanes, out, batch) -> Lane | None:
    """scaled_dot_product_attention: every tracked input on the same batch dimension."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    tracked = _tracked(args, kwargs, lanes)
    if any(t is not mask and not any(t is a for a in args[:3]) for t in tracked):
        return None
    lane = _same(_aligned(t, lanes[id(t)], out) for t in tracked)
    return lane if lane is not None and lane[0] < out.dim() - 2 else None


def _norm(args, kwargs, lanes, out, batch) -> Lane | None:
    """layer_norm, rms_norm over trailing dimensions the lane is not in."""
    lane = _only(args, kwargs, lanes)
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    return lane if lane is not None and lane[0] < args[0].dim() - k else None


def _per_example(args, kwargs, lanes, out, batch) -> Lane | None:
    """Convolutions, pooling, group and batch norms: examples on dimension 0, kept there."""
    lane = _only(args, kwargs, lanes)
    ok = lane is not None and lane[0] == 0 and out.dim() and out.shape[0] == args[0].shape[0]
    return lane if ok else None


def _unreduced(args: tuple, kwargs: dict) -> bool:
    """Whether a loss function is called on (input, target) with ``reduction="none"``, by
    keyword (no legacy ``size_average`` or ``reduce`` overriding it)."""
    legacy = kwargs.get("size_average") is not None or kwargs.get("reduce") is not None
    return len(args) == 2 and not legacy and kwargs.get("reduction") == "none"


def _pointwise_loss(args, kwargs, lanes, out, batch) -> Lane | None:
    """mse_loss, l1_loss, binary_cross_entropy(_with_logits) with ``reduction="none"``: one
    value per element of the broadcast input, target and weights, as an elementwise op."""
    return _broadcast(args, kwargs, lanes, out) if _unreduced(args, kwargs) else None


def _classes(args, kwargs, lanes, out, batch) -> Lane | None:
    """cross_entropy and nll_loss with ``reduction="none"``: (N, C, *d) scores and (N, *d)
    class ids (or (N, C, *d) probabilities) give (N, *d), each value from its own position's
    scores over the classes C; a class weight from the batch is left to the owner algebra."""
    x = args[0]
    if not _unreduced(args, kwargs) or x.dim() < 2:
        return None
    found = []
    for t in _tracked(args, kwargs, lanes):
        d, m = lanes[id(t)]
        if t is x or (t is args[1] and t.dim() == x.dim()):  # scores, or probabilities
            if d == 1:
                return None  # examples along the classes
            found.append((d - (d > 1), m))
        elif t is args[1]:  # class ids, shaped as the result
            found.append((d, m))
        else:
            return None
    return _same(found) if out.dim() == x.dim() - 1 else None


def _embedding(args, kwargs, lanes, out, batch) -> Lane | None:
    lane = _only(args, kwargs, lanes)
    return lane if lane is not None and out.dim() == args[0].dim() + 1 else None


def _reduction_named(name: str) -> Callable:
    def follow(args, kwargs, lanes, out, batch) -> Lane | None:
        lane, n = _only(args, kwargs, lanes), args[0].dim()
        if lane is None or not n:
            return None
        dims, keep = dims_of(name, args, kwargs, n)
        dims = {_dim(k, n) for k in dims}
        if not dims or None in dims or lane[0] in dims:
            return None
        return lane[0] - (0 if keep else sum(k < lane[0] for k in dims)), lane[1]

    return follow


_PER_EXAMPLE = (
    *("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    *("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"),
    *("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "interpolate"),
    *("adaptive_max_pool1d", "adaptive_max_pool2d", "pixel_shuffle", "pad", "batch_norm"),
    *("max_pool2d_with_indices", "group_norm", "instance_norm", "local_response_norm"),
)
_POINTWISE_LOSSES = (
    *("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy"),
    "binary_cross_entropy_with_logits",
)
_RULES: dict[str, Callable[..., Lane | None]] = {
    **dict.fromkeys(RESHAPES | {"squeeze", "unsqueeze"}, _reshape),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims"), _swap),
    **dict.fromkeys(("t", "T"), _reversed),
    "mT": _matrix_transpose,
    "permute": _permute,
    **dict.fromkeys(("movedim", "moveaxis"), _movedim),
    **dict.fromkeys(("expand", "expand_as"), _expand),
    "__getitem__": _index,
    **dict.fromkeys(("select", "narrow"), _select),
    **dict.fromkeys(("split", "chunk", "tensor_split", "split_with_sizes", "unbind"), _split),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _joined),
    **dict.fromkeys(CASTS, _cast),
    "linear": _linear,
    "addmm": _addmm,
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm"), _matmul),
    "scaled_dot_product_attention": _attention,
    **dict.fromkeys(("layer_norm", "rms_norm"), _norm),
    **dict.fromkeys(_PER_EXAMPLE, _per_example),
    "embedding": _embedding,
    **dict.fromkeys(("cross_entropy", "nll_loss"), _classes),
    **dict.fromkeys(_POINTWISE_LOSSES, _pointwise_loss),
    **{name: _reduction_named(name) for name in REDUCTIONS},
}
