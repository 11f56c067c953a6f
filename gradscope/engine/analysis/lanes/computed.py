"""The lanes of ops that compute each element from elements along other dimensions than the
lane's: products, attention, norms, convolutions, per-example losses, reductions
(``COMPUTED``, by op name)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ...ops import REDUCTIONS
from ..arguments import dims_of
from .base import Lane, aligned, axis, broadcast, only, same, tracked


def _linear(args, kwargs, lanes, out, batch) -> Lane | None:
    """linear(x, W, b) of a weight from no example, over x's last dimension."""
    lane = only(args, kwargs, lanes)
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
    if len(tracked(args, kwargs, lanes)) != (id(a) in lanes) + (id(b) in lanes):
        return None
    la, lb = lanes.get(id(a)), lanes.get(id(b))
    if la is None or la[0] == a.dim() - 1:  # b alone on the lane, or a's columns
        return None
    lane = aligned(a, la, out)
    if lb is None:
        return lane
    if lane is None or lane[0] >= out.dim() - 2 or aligned(b, lb, out) != lane:
        return None
    return lane


def _attention(args, kwargs, lanes, out, batch) -> Lane | None:
    """scaled_dot_product_attention: every tracked input on the same batch dimension."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    found = tracked(args, kwargs, lanes)
    if any(t is not mask and not any(t is a for a in args[:3]) for t in found):
        return None
    lane = same(aligned(t, lanes[id(t)], out) for t in found)
    return lane if lane is not None and lane[0] < out.dim() - 2 else None


def _norm(args, kwargs, lanes, out, batch) -> Lane | None:
    """layer_norm, rms_norm over trailing dimensions the lane is not in."""
    lane = only(args, kwargs, lanes)
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
    k = len(shape) if isinstance(shape, (list, tuple)) else 1
    return lane if lane is not None and lane[0] < args[0].dim() - k else None


def _per_example(args, kwargs, lanes, out, batch) -> Lane | None:
    """Convolutions, pooling, group norms: examples on dimension 0, kept there."""
    lane = only(args, kwargs, lanes)
    ok = lane is not None and lane[0] == 0 and out.dim() and out.shape[0] == args[0].shape[0]
    return lane if ok else None


def _batch_norm(args, kwargs, lanes, out, batch) -> Lane | None:
    """A batch norm on running statistics, per example; on the batch's own (``training``, the
    sixth argument of F.batch_norm and torch.batch_norm alike) every example mixes: followed
    as a contraction (``analysis/contractions.py``)."""
    if kwargs.get("training", args[5] if len(args) > 5 else False):
        return None
    return _per_example(args, kwargs, lanes, out, batch)


def _unreduced(args: tuple, kwargs: dict) -> bool:
    """Whether a loss function is called on (input, target) with ``reduction="none"``, by
    keyword (no legacy ``size_average`` or ``reduce`` overriding it)."""
    legacy = kwargs.get("size_average") is not None or kwargs.get("reduce") is not None
    return len(args) == 2 and not legacy and kwargs.get("reduction") == "none"


def _pointwise_loss(args, kwargs, lanes, out, batch) -> Lane | None:
    """mse_loss, l1_loss, binary_cross_entropy(_with_logits) with ``reduction="none"``: one
    value per element of the broadcast input, target and weights, as an elementwise op."""
    return broadcast(args, kwargs, lanes, out) if _unreduced(args, kwargs) else None


def _classes(args, kwargs, lanes, out, batch) -> Lane | None:
    """cross_entropy and nll_loss with ``reduction="none"``: (N, C, *d) scores and (N, *d)
    class ids (or (N, C, *d) probabilities) give (N, *d), each value from its own position's
    scores over the classes C; a class weight from the batch is left to the owner algebra."""
    x = args[0]
    if not _unreduced(args, kwargs) or x.dim() < 2:
        return None
    found = []
    for t in tracked(args, kwargs, lanes):
        d, m = lanes[id(t)]
        if t is x or (t is args[1] and t.dim() == x.dim()):  # scores, or probabilities
            if d == 1:
                return None  # examples along the classes
            found.append((d - (d > 1), m))
        elif t is args[1]:  # class ids, shaped as the result
            found.append((d, m))
        else:
            return None
    return same(found) if out.dim() == x.dim() - 1 else None


def _embedding(args, kwargs, lanes, out, batch) -> Lane | None:
    lane = only(args, kwargs, lanes)
    return lane if lane is not None and out.dim() == args[0].dim() + 1 else None


def _reduction_named(name: str) -> Callable:
    def follow(args, kwargs, lanes, out, batch) -> Lane | None:
        lane, n = only(args, kwargs, lanes), args[0].dim()
        if lane is None or not n:
            return None
        dims, keep = dims_of(name, args, kwargs, n)
        dims = {axis(k, n) for k in dims}
        if not dims or None in dims or lane[0] in dims:
            return None
        return lane[0] - (0 if keep else sum(k < lane[0] for k in dims)), lane[1]

    return follow


_PER_EXAMPLE = (
    *("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    *("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d"),
    *("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "interpolate"),
    *("adaptive_max_pool1d", "adaptive_max_pool2d", "pixel_shuffle", "pad"),
    *("max_pool2d_with_indices", "group_norm", "instance_norm", "local_response_norm"),
)
_POINTWISE_LOSSES = (
    *("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy"),
    "binary_cross_entropy_with_logits",
)
COMPUTED: dict[str, Callable[..., Lane | None]] = {
    "linear": _linear,
    "addmm": _addmm,
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm"), _matmul),
    "scaled_dot_product_attention": _attention,
    **dict.fromkeys(("layer_norm", "rms_norm"), _norm),
    **dict.fromkeys(_PER_EXAMPLE, _per_example),
    "batch_norm": _batch_norm,
    "embedding": _embedding,
    **dict.fromkeys(("cross_entropy", "nll_loss"), _classes),
    **dict.fromkeys(_POINTWISE_LOSSES, _pointwise_loss),
    **{name: _reduction_named(name) for name in REDUCTIONS},
}
