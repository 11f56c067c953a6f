"""The tap's reads of fused 3-D expert weights (``ParamTap`` is one): ``grouped_mm`` and
``bmm`` over all experts at once, each expert's matrix a Linear on the rows routed to it, placed
at ``W[e]``; and the recipes by which a routed region serves such reads, and ``F.linear`` of one
expert's ``W[e]``, again on a later batch (``replay/routed.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...rules import Contribution
from ...rules.linear import affine_parts
from ...rules.placed import Place, Placed
from ...rules.routed import gram_cheap
from ..derived import Derived, Watched
from ..ops import BIASED, EXPERT_READS
from ..recipes import ARG, Recipe
from ..rows import Lanes, regroup
from ..views import compose
from .owners import reduce, rows_of
from .policy import ASSUMED


class ExpertReads:
    """Uses the tap's batch, trace, ``_watched``, ``_rows`` and ``_read_output``."""

    def _grouped(self, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``grouped_mm(x, W, offs)``: rows offs[e-1]:offs[e] of x times W[e], the experts of a
        fused 3-D weight run on their sorted tokens: a Linear per expert, placed at W[e]."""
        x, weight = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        extra = [v for k, v in kwargs.items() if k != "offs" and v is not None]
        if len(args) > 3 or extra or self._watched(x) is not None or offs is None or x.dim() != 2:
            return None
        d = self._watched(weight)
        if (
            not isinstance(d, Derived)
            or weight.dim() != 3
            or (d.place.index and d.place.transposed)
        ):
            return None
        rows = self._rows(x, 1)
        if rows is False or rows is ASSUMED:
            return None
        out = func(*args, **kwargs)
        if not out.requires_grad:
            return out
        owner = torch.arange(self.batch, device=x.device) if rows is None else rows  # (S,)
        with torch._C.DisableTorchFunction():  # the tap's own read, not the model's
            a, ends = x.detach(), offs.tolist()

        def parts(grad: Tensor) -> dict[str, Contribution]:
            return self._experts(d, weight, a, grad, owner, ends)

        self._read_output(d.params, out, parts, args, _routed(d, weight, x))
        return out

    def _bmm(self, func, args: tuple, kwargs: dict) -> Tensor | None:
        """``bmm(x, W)`` of (E, N, in) tokens and a fused (E, in, out) weight (Llama 4's
        experts): a Linear per expert on its N rows, each row one example's, placed at W[e]."""
        if len(args) != 2 or kwargs:
            return None
        x, weight = args
        d = self._watched(weight)
        if d is None or weight.dim() != 3 or x.dim() != 3 or self._watched(x) is not None:
            return None
        if weight.shape[0] != x.shape[0]:  # one matrix for every x (VITS's relative positions)
            return None
        if isinstance(d, Derived) and d.place.index and d.place.transposed:
            return None
        o = reduce(self.trace.owner(x), [2], keepdim=False).expand(x.shape[:2])
        if not bool((o >= 0).all()):
            return None
        out = func(*args)
        if not out.requires_grad:
            return out
        owner, a = o.reshape(-1), x.detach().reshape(-1, x.shape[-1])
        ends = [(e + 1) * x.shape[1] for e in range(x.shape[0])]

        def parts(grad: Tensor) -> dict[str, Contribution]:
            return self._experts(d, weight, a, grad.reshape(-1, grad.shape[-1]), owner, ends)

        self._read_output(d.params, out, parts, args, _lanes_recipe(d, weight, x, o, self.batch))
        return out

    def _experts(self, d: Watched, weight: Tensor, a: Tensor, grad: Tensor, owner, ends) -> dict:
        """Expert e's Linear on rows ends[e-1]:ends[e] of ``a`` (owned by ``owner``), placed at
        W[e] in the parameter (a view of it), or in ``weight`` (computed from parameters: then
        carried back to them)."""
        blocks, start = [], 0
        for e, end in enumerate(ends):
            if end > start:
                rows = rows_of(owner[start:end], self.batch)
                (xs, g), counts = regroup(rows, self.batch, a[start:end], grad[start:end])
                part = affine_parts(xs, g, weight[e], None, True, counts)["weight"]
                if isinstance(d, Derived):
                    index = (e,) if not d.place.index else compose(d.place.index, (e,), 3)
                    place = Place(index, d.place.transposed, d.place.scale)
                    blocks.append(Placed(part, d.param.param.shape, place))
                else:
                    blocks.append(Placed(part, weight.shape, Place((e,))))
            start = end
        if not blocks:
            return {}
        merged = blocks[0]
        for block in blocks[1:]:
            merged = merged.merge(block)
        return {d.param.name: merged} if isinstance(d, Derived) else d.credit(merged)


def _expert_read(reads: list) -> bool:
    """Whether a linear read is of ``W[e]`` alone, one matrix of a 3-D parameter (an expert
    picked by a value): a read an open routed region serves again (``replay/routed.py``)."""
    if len(reads) != 1 or reads[0][0] != "weight":
        return False
    return _one_expert(reads[0][1], 3)


def _one_expert(d: Watched, dims: int) -> bool:
    """Whether ``d`` is ``W[e]``, the whole of one expert's slice of a parameter of ``dims``."""
    if not isinstance(d, Derived) or d.param.param.dim() != dims:
        return False
    index, param = d.place.index, d.param.param
    if not index or not isinstance(index[0], int):
        return False
    whole = all(_whole(k, n) for k, n in zip(index[1:], param.shape[1:], strict=False))
    return whole and not d.place.transposed and d.place.scale == 1.0


def expert_recipe(name: str, reads: list, x: Tensor) -> Recipe | None:
    """The recipe of ``F.linear(x, W[e])`` or ``x @ W[e]`` (W of (E, in, out): GPT-OSS's,
    Aria's) where ``_expert_read`` and the Gram of as many rows as every expert's would take
    (the batch's routing may send them all) is cheap."""
    matmul = name in EXPERT_READS and name != "linear"
    if name not in EXPERT_READS or (matmul and x.dim() != 2) or not _expert_read(reads):
        return None
    param = reads[0][1].param
    if not gram_cheap(x.shape[0] * param.param.shape[0], param.param.shape):
        return None
    roles = (("weight", param.name),)
    return Recipe(name, roles, tuple(x.shape), None, transposed=matmul, expert=True)


def expert_bias(name: str, i: int, d: Watched, args: tuple, shape: torch.Size) -> Recipe | None:
    """The recipe of ``x + b[e]``, one row of a 2-D parameter (an expert's bias, picked by a
    value) added to each row of a 2-D x at argument ``i`` (GPT-OSS's experts), where the Gram of
    as many rows as every expert's would take is cheap."""
    if name not in BIASED or len(args) != 2 or len(shape) != 2 or not _one_expert(d, 2):
        return None
    param = d.param.param
    if not gram_cheap(shape[0] * param.shape[0], param.shape):
        return None
    return Recipe(name, ((f"{ARG}{i}", d.param.name),), tuple(shape), None, expert=True)


def _whole(k: object, size: int) -> bool:
    """Whether index ``k`` takes the whole of a dimension of ``size``."""
    return (
        isinstance(k, slice)
        and k.start in (0, None)
        and k.step in (1, None)
        and (k.stop is None or k.stop >= size)
    )


def _lanes_recipe(d: Watched, weight: Tensor, x: Tensor, owner: Tensor, batch: int):
    """The recipe of ``bmm(x, W)`` of a whole 3-D parameter W whose (E, N) rows are laid out
    by shapes alone, row n of every expert example (n // m) % B (Llama 4's: every token through
    every expert), where the Gram of all E N rows is cheap: a light region serves it again."""
    if not isinstance(d, Derived) or weight is not d.param.param:
        return None
    if not gram_cheap(x.shape[0] * x.shape[1], weight.shape):
        return None
    first = owner[:1]  # (1, N): every expert's rows alike, or no recipe
    rows = rows_of(first, batch) if bool((owner == first).all()) else None
    if not isinstance(rows, Lanes) or rows.dim != 1:
        return None
    return Recipe("bmm", (("weight", d.param.name),), tuple(x.shape), rows, transposed=True)


def _routed(d: Derived, weight: Tensor, x: Tensor) -> Recipe | None:
    """A grouped read of a whole 3-D parameter (or its transpose) that a routed region serves
    again (``replay/routed.py``): its rows follow the batch's values, so their number alone is
    fixed. Whatever the rows' Gram costs: where more than the read (``gram_cheap``), ``Routed``
    takes each key's rows apart (a training step forms their G, and autograd's product of the
    weight's gradient is skipped), where a traced read costs a host sync per expert beside."""
    place = d.place
    if place.index or place.scale != 1.0:
        return None
    whole = weight is d.param.param or (place.transposed and weight._base is d.param.param)
    if not whole:
        return None
    roles = (("weight", d.param.name),)
    return Recipe("grouped_mm", roles, tuple(x.shape), None, transposed=not place.transposed)
