"""The decisions around the backward: which parameters the rules cannot serve on this batch.

Each moves a parameter to the fallback through ``Plan.to_fallback``, which records the reason.
Before the backward: raw parameters read by ops other than broadcasts, calls whose rows are not
the examples (the shapes, and once per model and shapes the probe), and what an earlier first
batch found. After it: a second output reaching the loss, a parameter reaching the loss where no
rule sees it, and on the first batch the self-check against autograd's batch gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .first_batch import Findings, agrees
from .plan import BROADCAST, ParamPlan, Plan
from .reduce import Reducer

if TYPE_CHECKING:
    from .core import Seen


def before_backward(plan: Plan, seen: Seen, findings: Findings) -> None:
    """Move to the fallback what reads rows that are not the examples, and raw parameters
    read by other ops than broadcast ones."""
    for p in plan.raw:
        if seen.tap.uses[p.name].other:
            plan.to_fallback(p, f"read by {seen.tap.uses[p.name].other}")
    probe, batch = None, seen.losses.shape[0]
    if (plan.by_rule or plan.raw) and findings.shared is None and batch > 1:
        probe = seen.losses[-1]  # once per model and shapes: later batches check shapes only
    shared = seen.session.not_per_example(batch, probe)
    if probe is not None:
        findings.shared = {m for m in plan.hooked_modules if id(m) in shared}
        for name in seen.tap.not_per_example(probe) if seen.tap else ():
            findings.failed[name] = "rows of its broadcast are not the examples"
    shared |= {id(m) for m in findings.shared or ()}
    for p in plan.by_rule:
        if any(id(m) in shared for m, _ in p.owners):
            plan.to_fallback(p, "rows of its module's output are not the examples")
    for p in plan.by_rule + plan.raw:
        if p.name in findings.failed:
            plan.to_fallback(p, findings.failed[p.name])


def after_backward(
    plan: Plan,
    seen: Seen,
    reducer: Reducer,
    checked: Sequence[ParamPlan],
    grads: Sequence[Tensor | None],
    findings: Findings,
    verify: bool,
) -> None:
    """Move to the fallback what the backward showed the rules cannot see."""
    session = seen.session
    views = seen.tap.views() if seen.tap else []
    for p in plan.by_rule:
        if any(c.others_reach_loss for m, _ in p.owners for c in session.calls.get(id(m), ())):
            plan.to_fallback(
                p, "a second output of its module (attention weights) reaches the loss"
            )
    for p in plan.by_rule:
        if p.name in findings.failed:
            plan.to_fallback(p, findings.failed[p.name])
    present = [g.double().norm() for g in grads if g is not None]
    total = torch.stack(present).norm().item() if verify and present else 0.0
    for p, g in zip(checked, grads, strict=True):
        if p.is_fallback:
            continue
        reached = any(c.reached for m, _ in p.owners for c in session.calls.get(id(m), ()))
        reached |= any(v.reached for v in views if v.param is p)
        if not reached and g is not None:
            where = (
                "where no rule sees it" if p.rule == BROADCAST else "without a call of its module"
            )
            plan.to_fallback(p, f"used {where}")
            continue
        ours = reducer.sums.get(p.name, torch.zeros_like(p.param))
        if verify and not agrees(ours, torch.zeros_like(p.param) if g is None else g, total):
            findings.failed[p.name] = (
                "its rule's gradients do not add up to autograd's (used outside its module?)"
            )
            plan.to_fallback(p, findings.failed[p.name])
        elif verify and p.rule == BROADCAST:
            p.note = ""  # served: no longer "no rule for ..."
    for p in plan.fallback:
        reducer.forget(p.name)
