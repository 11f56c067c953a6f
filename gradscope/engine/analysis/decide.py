"""The decisions around the backward: which parameters the rules cannot serve on this batch.

Each moves a parameter to the fallback through ``Plan.to_fallback``, which records the reason
for every later pass. Before the backward: raw parameters read by ops other than broadcasts, and
calls whose rows the trace (``trace.py``) cannot give each to one example; a row-by-row call in
another layout than one row per example gets its rows' owners, for the rule to gather. After
it: a second output reaching the loss, a parameter reaching the loss where no rule sees it, and
on an analysed batch the self-check against autograd's batch gradient and two examples' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd

from ...rules import find_rule
from ..plan import BROADCAST, ParamPlan, Plan
from ..rows import Gather
from .owners import NONE, is_batch, lane_of, reduce, rows_of, segment_combine
from .selfcheck import Singles, close, precision

if TYPE_CHECKING:
    from ..backward.reduce import Reducer
    from ..capture import Call
    from .analyse import Analysed
    from .trace import RowTrace


def before_backward(plan: Plan, seen: Analysed) -> None:
    """Move to the fallback what reads rows that are not the examples', and parameters read
    outside their rules' module calls by other ops than those the tap serves."""
    for p in plan.raw + plan.by_rule if seen.tap else ():
        if seen.tap.uses[p.name].other:
            plan.to_fallback(p, f"read by {seen.tap.uses[p.name].other}")
    if not seen.trace.per_example(seen.losses, seen.losses.shape[0]):
        for p in plan.by_rule + plan.raw:
            plan.to_fallback(p, f"the losses mix examples{_after(seen, seen.losses)}")
        return
    lost: dict[int, str] = {}
    for call in seen.session.all_calls():
        reason = layout_of(call, seen.trace)
        if reason:
            after = _after(seen, call.inputs[0]) if "mix " in reason else ""
            lost.setdefault(id(call.module), reason + after)
    for p in plan.by_rule:
        reason = next((lost[id(m)] for m, _ in p.owners if id(m) in lost), None)
        if reason:
            plan.to_fallback(p, reason)


def _after(seen: Analysed, t: Tensor) -> str:
    op = seen.trace.mixed_at(t)
    return f" (after {op})" if op else ""


def layout_of(call: Call, trace: RowTrace) -> str | None:
    """Why ``call``'s rows cannot be read per example, or None; sets ``call.rows`` where a
    row-by-row rule must gather them."""
    rule, batch = find_rule(call.module), trace.batch
    if not call.owners:
        return "a call without tensor inputs"
    x, owners = call.inputs[0], call.owners[0]
    features = rule.rows(call.module) if rule.rows else None
    if features is not None and len(call.inputs) == 1 and x.dim() > features:
        if trace.one_row_each(x, owners, features):
            return None
        rows = reduce(owners, range(x.dim() - features, x.dim()), keepdim=False)
        rows = rows.expand(x.shape[: x.dim() - features])  # owners may be compact
        if x.numel() == 0:  # no row routed to it on this batch: zeros, gathered
            zeros = torch.zeros(x.shape[: x.dim() - features], dtype=torch.long, device=x.device)
            call.rows = Gather.of(zeros, batch)
            return None
        if is_batch(rows.reshape(rows.shape[0], -1), batch):
            return None
        if rows.dim() <= 2 and x.shape[0] == batch and lane_of(rows, batch) == (0, 1):
            return None  # x[i] example i's, by values: read as it is, as ``one_row_each`` reads
        if bool((rows >= 0).all()):
            call.rows = rows_of(rows, batch)
            return None
        return _why(rows)
    bagged = rule.bags(call.module, call.inputs, call.kwargs) if rule.bags else None
    if bagged is not None:
        return _bagged(x, owners, *bagged, batch)
    dim = rule.batch_dim(call.module, call.inputs) if rule.batch_dim else 0
    if dim is None:
        return "an unbatched call: its rows are not the examples"
    for k, (t, o) in enumerate(zip(call.inputs, call.owners, strict=True)):
        if dim == 0 and trace.is_standard(o):
            continue  # row i example i's: no compare needed
        if k and bool((o == NONE).all()):
            continue  # a mask or table shared by every example: the rule reads it as such
        per = reduce(o, [d for d in range(t.dim()) if d != dim], keepdim=True)
        if t.dim() <= dim or not is_batch(per.movedim(dim, 0), batch):
            return _why(per)
    return None


def _bagged(x: Tensor, owners: Tensor, bag: Tensor, count: int, batch: int) -> str | None:
    """Why bags of ``x``'s positions (``Rule.bags``; the rows of dimension 0) are not the
    examples, or None: bag i's positions all example i's, a bag of none empty."""
    base = torch.full((count,), NONE, dtype=torch.long, device=x.device)
    rows = reduce(owners, range(1, x.dim()), keepdim=False).expand(x.shape[:1]).contiguous()
    per = segment_combine(base, bag, rows)  # (bags,)
    sizes = torch.zeros(count, dtype=torch.long, device=x.device).index_add_(
        0, bag, torch.ones_like(bag)
    )
    if count != batch:
        return f"its {count} bags are not the batch's {batch} examples"
    own = (per == torch.arange(batch, device=x.device)) | (sizes == 0)
    return None if bool(own.all()) else _why(per)


def _why(owners: Tensor) -> str:
    if bool((owners == NONE).all()):
        return "rows of its input are not the examples: the batch shares them"
    if bool((owners < 0).any()):
        return "rows of its input are not the examples: they mix examples"
    return "rows of its input are not the examples"


def counted(p: ParamPlan) -> bool:
    """Whether ``p`` is an ``nn.Embedding`` or ``nn.EmbeddingBag`` table that divides each
    row's gradient by its count (``scale_grad_by_freq``): autograd's backward of one example in
    the batch counts the rows of the whole batch, the rule each example's alone, so only the
    batch sums compare (the rule's counts its examples' gradients as autograd counts the
    batch's: ``Rows``)."""
    tables = (nn.Embedding, nn.EmbeddingBag)
    return any(isinstance(m, tables) and m.scale_grad_by_freq for m, _ in p.owners)


def after_backward(
    plan: Plan,
    seen: Analysed,
    reducer: Reducer,
    checked: Sequence[ParamPlan],
    grads: Sequence[Tensor | None],
    singles: Singles | None,
    verify: bool,
) -> None:
    """Move to the fallback what the backward showed the rules cannot see."""
    session = seen.session
    reads = seen.tap.reads() if seen.tap else []
    read = {p.name for u in reads if u.reached for p in u.params}  # reached through a read
    for p in plan.by_rule:
        if any(c.others_reach_loss for m, _ in p.owners for c in session.calls.get(id(m), ())):
            plan.to_fallback(
                p, "a second output of its module (attention weights) reaches the loss"
            )
    present = [g.double().norm() for g in grads if g is not None]
    total = torch.stack(present).norm().item() if verify and present else 0.0
    for k, (p, g) in enumerate(zip(checked, grads, strict=True)):
        if p.is_fallback:
            continue
        reached = any(c.reached for m, _ in p.owners for c in session.calls.get(id(m), ()))
        reached |= p.name in read
        if not reached and g is not None:
            where = (
                "where no rule sees it" if p.rule == BROADCAST else "without a call of its module"
            )
            plan.to_fallback(p, f"used {where}")
            continue
        if not verify:
            continue
        why = _differs(p, k, reducer, g, total, singles)
        if why:
            plan.to_fallback(p, why)
        elif p.rule == BROADCAST:
            p.note = ""  # served: no longer "no rule for ..."
    for p in plan.fallback:
        reducer.forget(p.name)


def _differs(
    p: ParamPlan, k: int, reducer: Reducer, g: Tensor | None, total: float, singles: Singles
) -> str | None:
    """Why ``p``'s rule is not autograd's on this batch (the self-check), or None: its sum
    over the examples against ``g``, the batch gradient, then its norms against the
    ``singles``' own backward (``k``: its place among them), at the precision of its products."""
    ours = reducer.sums.get(p.name, torch.zeros_like(p.param))
    norm_sq = reducer.norm_sq.get(p.name)  # (B,) the terms' magnitude: their norms, summed
    scale = 0.0 if norm_sq is None else norm_sq.double().clamp_min(0).sqrt().sum().item()
    at = precision(p.param, any(isinstance(m, _ConvNd) for m, _ in p.owners))
    if not close(ours, torch.zeros_like(p.param) if g is None else g, at, scale, total):
        return "its rule's gradients do not add up to autograd's (used outside its module?)"
    if not counted(p) and not singles.agree(k, norm_sq, at):
        return "its rule's gradient of one example differs from its backward"
    return None
