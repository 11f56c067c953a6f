"""The math of a read's per-example contributions, shared by the tap (``analysis/``) and the
light regions (``replay/light.py``, ``replay/reads.py``): each function's arguments bound by
name, and output gradient -> the contribution of each role (weight, bias) of a linear,
embedding or product read, a convolution, a parameter broadcast along the rows or element by
element."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rules import Contribution, Dense
from ..rules.conv import weight_part
from ..rules.embedding import lookup
from ..rules.linear import affine_parts
from ..rules.routed import Routed
from .rows import Lanes, Layout, regroup


def read_parts(
    op: str,
    a: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: Layout | None,
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


def lane_experts(a: Tensor, grad: Tensor, m: int, batch: int) -> Routed:
    """W's contribution of ``bmm(a, W)``, a (E, N, in) and W (E, in, out) (Llama 4's experts),
    row n of every expert example (n // m) % B: expert e's Linear on a[e], as routed rows."""
    e, n = a.shape[:2]
    own = (torch.arange(n, device=a.device) // m % batch).repeat(e)  # (E N,)
    expert = torch.arange(e, device=a.device).repeat_interleave(n)  # (E N,)
    shape = (e, a.shape[2], grad.shape[2])
    return Routed(a.reshape(e * n, -1), grad.reshape(e * n, -1), own, expert, shape, batch, True)


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


def owned(mine: Tensor, slot: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """``element_parts``' elements, found once where the analysis lays them out: of a view's
    elements flattened (``mine``: whether one example owns each), the indices of those one
    example owns (None: every one) and of the others (None: none), and ``slot``."""
    every = bool(mine.all())
    own = None if every else mine.nonzero().squeeze(1)
    return own, None if every else (~mine).nonzero().squeeze(1), slot


def element_parts(
    own: Tensor | None, others: Tensor | None, slot: Tensor, batch: int, shape: torch.Size
) -> Callable[[Tensor], Dense]:
    """output gradient at a view of a tensor of ``shape`` broadcast element by element ->
    each example's gradient of it: the gradient at the elements it owns (``own``, as
    ``owned`` tells them), each summed into its ``slot`` (example, element of the tensor it
    broadcasts from). An element of several examples or of none (``others``) that gets a
    gradient fails the read (the losses mix); where there is none, nothing is read on the
    host."""

    def parts(grad: Tensor) -> Dense:
        g = grad.reshape(-1)
        if others is not None and bool(g[others].ne(0).any()):
            raise ValueError("an element of several examples or none reaches the loss")
        mine = g if own is None else g[own]
        per = g.new_zeros(batch * shape.numel()).index_add_(0, slot, mine)
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


def product_part(
    a: Tensor, shape: torch.Size, left: bool, slot: Tensor, batch: int
) -> Callable[[Tensor], Dense]:
    """output gradient -> each example's gradient of a W of ``shape`` in ``W @ a`` (``left``)
    or ``a @ W`` whose leading dimensions broadcast (Zamba's per-head ``W[:, None] @ x``, a
    relative-position table projected once for the batch and multiplied by each example's
    queries): each product's gradient, ``grad @ a.mT`` or ``a.mT @ grad``, summed into its
    ``slot`` (example, matrix of W: ``owners.slots``)."""
    matrices = shape[:-2].numel()

    def part(grad: Tensor) -> Dense:
        g = (grad @ a.mT if left else a.mT @ grad).reshape(-1, *shape[-2:])
        per = g.new_zeros(batch * matrices, *g.shape[1:]).index_add_(0, slot, g)
        return Dense(per.view(batch, *shape))

    return part


def einsum_part(
    per_row: str, a: Tensor, rows: Tensor | None, batch: int
) -> Callable[[Tensor], Dense]:
    """output gradient -> each example's gradient of W in ``einsum(eq, x, W)`` whose batch
    index of ``x`` (at any position: XLNet's sequence-first ``ibh``) is the output's too and
    not W's: ``einsum(per_row, a, grad)``, the einsum summed over every index but the batch's
    and W's, one W per row of x along the batch index, summed over each example's rows
    (``rows``: the example of each; None where row r is example r's; SAM's and Funnel's
    relative attention)."""

    def part(grad: Tensor) -> Dense:
        g = torch.einsum(per_row, a, grad)  # (rows, *W)
        if rows is not None:
            g = g.new_zeros(batch, *g.shape[1:]).index_add_(0, rows, g)
        return Dense(g)

    return part


def einsum_read(equation: object, operands: tuple, watched: Callable) -> tuple | None:
    """(x, W, per dimension of x: the per-row equation of ``einsum_part`` with that dimension
    the batch's, or None where its index is W's or not the output's) of a two-operand einsum of
    a batch x and a watched W (``watched(t)``: not None for one), W's indices all x's or the
    output's; None for any other, or where no dimension of x can be the batch's."""
    bound = einsum_terms(equation, operands)
    if bound is None:
        return None
    first, second, out = bound
    if watched(first[0]) is not None:
        first, second = second, first
    (x, xs), (weight, ws) = first, second
    if watched(weight) is None or watched(x) is not None or not set(ws) <= set(xs) | set(out):
        return None
    per_row = tuple(f"{xs},{out}->{i}{ws}" if i in out and i not in ws else None for i in xs)
    return None if all(e is None for e in per_row) else (x, weight, per_row)


def einsum_operands(args: tuple, kwargs: dict) -> tuple:
    """The operands of ``torch.einsum(eq, *operands)`` or ``torch.einsum(eq, [operands])``."""
    if kwargs:
        return ()
    return args[1:] if len(args) > 2 else tuple(args[1]) if len(args) == 2 else ()


def viewed_parts(parts: Callable, viewed: Callable) -> Callable:
    """``parts`` of a read whose output is a view of the tensor its gradient arrives at."""
    return lambda grad: parts(viewed(grad))


def einsum_terms(equation: object, operands: tuple) -> tuple | None:
    """((operand, its indices), (operand, its indices), the output's indices) of a two-operand
    einsum; None for other equations (an ellipsis, an implicit output, a repeated index)."""
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
        return None
    equation = equation.replace(" ", "")
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if "." in equation or len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    if not all(
        isinstance(t, Tensor) and t.dim() == len(s) for t, s in zip(operands, terms, strict=True)
    ):
        return None
    return (operands[0], terms[0]), (operands[1], terms[1]), out


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
