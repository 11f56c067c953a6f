"""Recipes: how a read of parameters that the analysed batch served is served again on a later
batch without the trace (``replay/light.py``, ``replay/routed.py``): the function, the
parameters at its roles, its input's shape and rows (the math each kind of read gives its
contributions by is ``parts.py``'s); and what a watched parameter may be asked without being
read, and the functions the tap and the light regions open to see the ops inside them."""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rules.placed import Place
from .derived import Computed, Derived
from .ops import METADATA, op_name
from .rows import Lanes


@dataclass(frozen=True)
class Recipe:
    """One read of whole parameters by a function: ``op`` (linear, embedding, or a product
    ``x @ W``), the parameters at its roles ((role, name): weight, bias), its input's shape,
    the layout of its rows (None: one row per example on dimension 0, or, for ``grouped_mm``,
    rows a routed region follows: ``replay/routed.py``), the autograd nodes made from the region
    call's start to the read's end, whether a grouped product reads W itself ((E, in, out)),
    not its transpose, and whether a linear one reads one expert's matrix of a 3-D W."""

    op: str
    roles: tuple[tuple[str, str], ...]
    shape: tuple[int, ...]
    rows: Lanes | None
    at: int = 0
    transposed: bool = False
    expert: bool = False  # ``F.linear`` of ``W[e]``, a 3-D W's matrix that a value picks
    # the roles that take a tensor made from their parameters (a view, a cast, ``exp(a)``, a
    # weight-norm weight: ``replay/light.py`` makes it again), not a parameter itself
    computed: tuple[str, ...] = ()
    # whether a computed role's tensor was made with constants too (a buffer, an ``arange``):
    # only a mode that sees every op tells those from the batch's (``replay/intercept.py``)
    constants: bool = False
    left: bool = False  # ``W @ x``: a 2-D W on the left of a batch x of (B, in, L) (Mamba's),
    # or, with ``slot``, a W whose leading dimensions broadcast against x's
    # a product whose leading dimensions broadcast (``parts.product_part``): the (example,
    # matrix of W) each product sums into; an einsum's (``parts.einsum_part``): the example of
    # each row of x (None: row r example r's), with its per-row equation
    slot: Tensor | None = field(default=None, compare=False)
    equation: str | None = None
    expand: bool = False  # its input, no example's, expanded to the batch (a position table's)
    # its B rows, some or all of no example, taken as the examples' (the rows policy's): a read
    # even where its input is made from constants alone (positions by an arange expanded to
    # the batch), which a light region following constants would take for a computed tensor
    assumed: bool = False
    # a broadcast each element of whose result one example owns, or none (a CLIP-like (B, B)
    # similarity): which elements one example owns, which not, and the slot of each
    # (``parts.owned``)
    elements: tuple[Tensor | None, Tensor | None, Tensor] | None = field(
        default=None, compare=False
    )

    @property
    def kind(self) -> tuple:
        """What an open routed region matches a read by: the function, the parameters, the
        view of them (``replay/routed.py``)."""
        return self.op, self.roles, self.transposed, self.expert

    def names(self, role: str) -> tuple[str, ...]:
        """The parameters at ``role``: one, or those its tensor is made from."""
        return tuple(name for r, name in self.roles if r == role)


def recipe_roles(
    reads: Iterable[tuple[str, object]], given: dict
) -> tuple[tuple, tuple, bool] | None:
    """The roles of a read, which of them are computed (``Recipe.computed``), and whether any
    of those was made with constants (``Recipe.constants``), where each takes a whole
    parameter, a view or cast of one, or a tensor made from parameters and constants alone
    (``Computed.pure``); None for any other. ``given``: the tensor at each role."""
    roles: list[tuple[str, str]] = []
    computed: list[str] = []
    constants = False
    for role, d in reads:
        if isinstance(d, Derived) and given[role] is d.param.param:
            roles.append((role, d.param.name))
        elif isinstance(d, Derived) or (isinstance(d, Computed) and d.pure):
            roles += [(role, p.name) for p in d.params]
            computed.append(role)
            constants = constants or (isinstance(d, Computed) and not d.alone)
        else:
            return None
    return tuple(roles), tuple(computed), constants


def lookup(d: object, args: tuple) -> bool:
    """Whether ``W[ids]``, ``args`` its arguments and ``d`` what ``W`` reads, is
    ``F.embedding(ids, W)`` (Whisper's decoder positions): a whole 2-D parameter, integer ids.
    The tap serves it so; a light region runs it so, as the analysed read was run."""
    ids = args[1] if len(args) == 2 else None
    return (
        isinstance(d, Derived)
        and d.place == Place()
        and args[0].dim() == 2
        and isinstance(ids, Tensor)
        and ids.dim() > 0
        and not (ids.is_floating_point() or ids.dtype == torch.bool)
    )


# each function met: whether it asks a tensor what it is (a property's new ``__get__`` on each
# read is equal to, and hashes as, the last: one entry)
_ASKS: dict[Callable, bool] = {}


def metadata(func) -> bool:
    """Whether ``func`` asks a tensor what it is (its shape, dtype, ...) without reading it:
    asked on every op a region's mode or the row flow sees, so kept once found."""
    asks = _ASKS.get(func)
    if asks is None:
        asks = _ASKS[func] = _metadata(func)
    return asks


def _metadata(func) -> bool:
    if getattr(func, "__name__", "") == "__get__":  # a property, unless a view (W.T)
        return op_name(func) not in ("T", "mT", "H", "mH")
    return op_name(func) in METADATA


ARG = "arg"  # a broadcast recipe's role: the position of the parameter among the op's arguments


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


def group_norm_math(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.group_norm`` with its affine written out (BiT's ``BitGroupNormActivation`` calls it
    on its own weight and bias): the normalisation, its channels moved last, then the weight
    and the bias themselves, no view of them, broadcast along the rows: reads the tap serves.
    The result is laid out as the input (an elementwise op keeps its operand's strides) and
    in its dtype (a bfloat16 input with float32 parameters), as the fused function gives it."""
    out = F.group_norm(input, num_groups, None, None, eps).movedim(1, -1)  # (B, *spatial, C)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.movedim(-1, 1).to(input.dtype)


def normed_by(args: tuple, kwargs: dict, watched: Callable) -> bool:
    """Whether a ``group_norm`` call takes a watched tensor as its weight or bias."""
    names = ("input", "num_groups", "weight", "bias")
    given = dict(zip(names, args, strict=False)) | kwargs
    return any(watched(given.get(k)) is not None for k in ("weight", "bias"))


def written_out(name: str, args: tuple, kwargs: dict, watched: Callable) -> Callable | None:
    """What the op ``name`` runs as where it reads a watched tensor inside it, so that the tap
    sees the read as ops it serves (and a light region as the tap did): an attention masked by
    one (``sdpa_math``), a group norm of a watched weight or bias (``group_norm_math``); None
    for any other op."""
    if name == "scaled_dot_product_attention" and masked_by(args, kwargs, watched):
        return sdpa_math
    if name == "group_norm" and normed_by(args, kwargs, watched):
        return group_norm_math
    return None


def masked_by(args: tuple, kwargs: dict, watched: Callable) -> bool:
    """Whether an attention call without dropout takes a watched tensor as its mask."""
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return dropout == 0 and watched(mask) is not None
