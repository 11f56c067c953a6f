"""Forward-mode rules the jvp engine runs in place of autograd's, for what autograd's cost most:
``F.linear``'s partial sums, and every op where a dual meets a tensor or a number without a
tangent. Autograd gives the latter a zero tangent that is an ``_efficientzerotensor``, whose ops
work out their output's shape by Python meta functions: ``0.5 * x`` on a dual cost 2 ms on a
(4, 16, 256) tensor where the product itself costs 0.1 ms, and each attention's mask and scale
paid it again inside ``scaled_dot_product_attention``. Each rule here forms its tangent from the
primals as autograd's formula does, with the zero terms left out.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


# forward_ad's make_dual and unpack_dual less their checks, 15 and 10 us a call where these
# take 4 and 3: hundreds of calls a pass
def _unpacked(x: object, level: int) -> tuple[object, Tensor | None]:
    """(primal, tangent) of a dual; (x, None) for a plain tensor or a number."""
    return tuple(torch._unpack_dual(x, level)) if isinstance(x, Tensor) else (x, None)


def _made(out: Tensor, tangent: Tensor | None, level: int) -> Tensor:
    """``out`` with ``tangent``; ``out`` itself where it has none."""
    return out if tangent is None else torch._make_dual(out, tangent, level=level)


def _dual(out: Tensor, tangent: Tensor, level: int, fresh: bool = True) -> Tensor:
    """``out`` with ``tangent`` widened to its shape and dtype (a broadcast operand's); copied
    where not ``fresh`` (an operand's own tangent), so that no in-place op on one dual later
    moves another's."""
    if tangent.shape != out.shape or tangent.dtype != out.dtype:
        tangent = tangent.expand(out.shape).to(out.dtype, copy=True)
    elif not fresh:
        tangent = tangent.clone()
    return _made(out, tangent, level)


def _linear(level: int, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` on dual numbers, its tangent ``x_t W^T + x W_t^T + b_t`` summed in place.

    Autograd's forward-mode rule for it forms the three terms and their partial sums before it
    lets any go: three more tensors of the output's size at every layer, which on an MLP was the
    engine's peak. Here the first term is the tangent and the others are added into it.
    """
    if weight.dim() != 2:
        return NotImplemented
    (x, x_t), (weight, w_t), (bias, b_t) = (_unpacked(t, level) for t in (x, weight, bias))
    out = F.linear(x, weight, bias)  # (..., out)
    tangent = None
    if x_t is not None:
        tangent = F.linear(x_t, weight)  # (..., out): x_t W^T
    if w_t is not None:
        if tangent is None:
            tangent = F.linear(x, w_t)
        elif tangent.is_contiguous():  # += x W_t^T, into the tangent: (N, in) @ (in, out)
            tangent.view(-1, out.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), w_t.T)
        else:
            tangent = tangent + F.linear(x, w_t)
    if b_t is not None:
        tangent = b_t.expand_as(out).clone() if tangent is None else tangent.add_(b_t)
    return _made(out, tangent, level)


def _conv(level: int, conv, x: Tensor, weight: Tensor, bias: Tensor | None = None, *rest, **kw):
    """``conv(x, weight, bias, *rest)`` (a convolution or a transposed one) on dual numbers:
    autograd's tangent ``conv(x_t, W) + conv(x, W_t, b_t)``, the second added into the first.

    Autograd's rule forms both terms and their sum, and where ``x`` has no tangent (the first
    layer) it convolves a zero tensor of the input's size: on a small CNN, the engine's peak.
    """
    (x, x_t), (weight, w_t), (bias, b_t) = (_unpacked(t, level) for t in (x, weight, bias))
    out = conv(x, weight, bias, *rest, **kw)  # (B, C_out, *spatial)
    tangent = None if x_t is None else conv(x_t, weight, None, *rest, **kw)
    if w_t is not None:
        by_w = conv(x, w_t, b_t, *rest, **kw)
        tangent = by_w if tangent is None else tangent.add_(by_w)
    elif b_t is not None:  # (C_out,) along the channels, before the spatial dims
        b_t = b_t.view(-1, *[1] * (weight.dim() - 2))
        tangent = b_t.expand_as(out).clone() if tangent is None else tangent.add_(b_t)
    return _made(out, tangent, level)


_CONV = (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)


def _binary(level: int, op: str, a: object, b: object, alpha: float = 1) -> Tensor:
    """``a op b`` (mul, add, sub, div; ``rsub`` and ``rdiv`` with the operands swapped) where
    exactly one operand is a dual; NotImplemented otherwise (autograd's rule then)."""
    if op in ("rsub", "rdiv"):
        op, a, b = op[1:], b, a
    (a, a_t), (b, b_t) = _unpacked(a, level), _unpacked(b, level)
    if (a_t is None) == (b_t is None):
        return NotImplemented
    if op == "mul":
        out = torch.mul(a, b)
        return _dual(out, a_t * b if a_t is not None else a * b_t, level)
    if op == "div":
        out = torch.div(a, b)
        return _dual(
            out, a_t / b if a_t is not None else out / b * -b_t, level
        )  # d(a/b) = -a/b^2 db
    out = torch.add(a, b, alpha=alpha) if op == "add" else torch.sub(a, b, alpha=alpha)
    if a_t is not None:
        return _dual(out, a_t, level, fresh=False)
    return _dual(out, b_t * (alpha if op == "add" else -alpha), level)


def _grouped(level: int, a: Tensor, b: Tensor, *, offs: Tensor | None = None, **rest) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` (routed experts' matrices, which autograd's
    forward mode lacks): bilinear, its tangent a_t b + a b_t by the same grouped product.
    A bias or an output dtype: NotImplemented."""
    if any(v is not None for v in rest.values()):
        return NotImplemented
    (a, a_t), (b, b_t) = _unpacked(a, level), _unpacked(b, level)
    out = torch._grouped_mm(a, b, offs=offs)
    tangent = None if a_t is None else torch._grouped_mm(a_t, b, offs=offs)
    if b_t is not None:
        by_b = torch._grouped_mm(a, b_t, offs=offs)
        tangent = by_b if tangent is None else tangent.add_(by_b)
    return _made(out, tangent, level)


_BINARY = {
    f: op
    for op, fs in {
        "mul": (torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__),
        "add": (torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__),
        "sub": (torch.sub, Tensor.sub, Tensor.__sub__),
        "rsub": (Tensor.__rsub__,),
        "div": (torch.div, Tensor.div, Tensor.__truediv__),
        "rdiv": (Tensor.__rtruediv__,),
    }.items()
    for f in fs
}


def _attention(
    level: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Scaled-dot-product attention on duals, by its math: S = q k^T c (+ mask), P =
    softmax(S), out = P v, and out_t = P_t v + P v_t with P_t = P (S_t - sum(P S_t)),
    S_t = (q_t k^T + q k_t^T) c. A dual mask or dropout: autograd's rule."""
    (q, q_t), (k, k_t), (v, v_t) = (_unpacked(t, level) for t in (q, k, v))
    if dropout_p or _unpacked(attn_mask, level)[1] is not None:
        return NotImplemented
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # each key and value head serves a group
        n = q.shape[-3] // k.shape[-3]
        k, k_t, v, v_t = (
            None if t is None else t.repeat_interleave(n, -3) for t in (k, k_t, v, v_t)
        )
    c = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.mT).mul_(c)  # (..., L, S)
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_()
        s = s.masked_fill_(~keep, -math.inf)
    if attn_mask is not None:
        s = (
            s.masked_fill_(~attn_mask, -math.inf)
            if attn_mask.dtype == torch.bool
            else s.add_(attn_mask)
        )
    p = torch.softmax(s, -1).nan_to_num_(0.0)  # a row of no key: zeros, as SDPA gives
    out = p @ v  # (..., L, E_v)
    s_t = None
    if q_t is not None:
        s_t = q_t @ k.mT
    if k_t is not None:
        s_t = q @ k_t.mT if s_t is None else s_t.add_(q @ k_t.mT)
    tangent = None
    if s_t is not None:
        s_t.mul_(c)
        p_t = s_t.sub_((p * s_t).sum(-1, keepdim=True)).mul_(p)  # (..., L, S)
        tangent = p_t @ v
    if v_t is not None:
        tangent = p @ v_t if tangent is None else tangent.add_(p @ v_t)
    return _made(out, tangent, level)


class Tangents(TorchFunctionMode):
    """``F.linear`` (and ``torch.addmm`` of a bias row), convolutions, routed experts' grouped
    products, scaled-dot-product attention and the arithmetic of a dual with a plain operand by
    the rules above; every other op by autograd's own forward-mode rule. ``level``:
    the ``fwAD.dual_level`` whose duals these are."""

    def __init__(self, level: int = 0):
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = NotImplemented
        if func is F.linear and len(args) >= 2 and not set(kwargs) - {"bias"}:
            out = _linear(self.level, *args, **kwargs)
        elif func is torch.addmm and len(args) == 3 and not kwargs and args[0].dim() == 1:
            out = _linear(self.level, args[1], args[2].mT, args[0])  # b + x W: GPT-2's Conv1D
        elif func in _CONV and len(args) >= 2:
            out = _conv(self.level, func, *args, **kwargs)
        elif func is torch._grouped_mm and len(args) == 2:
            out = _grouped(self.level, *args, **kwargs)
        elif func is F.scaled_dot_product_attention:
            out = _attention(self.level, *args, **kwargs)
        elif func in _BINARY and len(args) == 2 and not set(kwargs) - {"alpha"}:
            out = _binary(self.level, _BINARY[func], *args, **kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out
