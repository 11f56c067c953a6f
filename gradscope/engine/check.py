"""`gradscope check`: the fast engine against the per-example loop on a few examples."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from rich.console import Group
from rich.table import Table
from torch import Tensor

from ..rules.base import rows
from .analysis.selfcheck import tolerance
from .engine import Engine
from .influence import Influence, reference_gradients
from .naive import naive_grads
from .plan import Plan

TOTAL = "(all)"  # the row of the whole gradient's norm


@dataclass
class CheckReport:
    plan: Plan
    errors: dict[str, float]  # module (and TOTAL) -> max|fast - loop| / max|loop| over examples
    examples: int
    tolerance: float
    # module, "hooks", "jvp" -> influence error in cosine units (``influence_errors``)
    influence: dict[str, float] = field(default_factory=dict)
    non_finite: int = 0  # examples left out: their loss is NaN or inf, no error to measure

    @property
    def worst(self) -> float:
        finite = [e for e in self.influence.values() if not math.isnan(e)]  # NaN: jvp cannot run
        return max([*self.errors.values(), *finite])

    @property
    def ok(self) -> bool:
        return self.worst <= self.tolerance


def _relative(fast: Tensor, loop: Tensor) -> float:
    scale = loop.abs().max()
    diff = (fast - loop).abs().max()
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return (diff / scale).item()


def compare_with_loop(engine: Engine, inputs: tuple[Tensor, ...], targets: Tensor) -> CheckReport:
    """Per-module gradient norms of the engine and of one backward per example, compared.

    The engine must be entered (``with engine:``). The engine runs first, so the plan the
    report holds says how each parameter was finally served.
    """
    fast = engine.norms(inputs, targets).norm_sq
    names = [p.name for p in engine.plan.included]
    _, grads = naive_grads(engine.model, inputs, targets, engine.loss_fn, names, engine.forward)
    loop = {n: rows(g).double().pow(2).sum(1) for n, g in grads.items()}  # (B,) each
    errors: dict[str, float] = {}
    for module in engine.plan.modules:
        params = [p.name for p in engine.plan.included if p.module == module]
        errors[module] = _relative(
            sum(fast[n].double() for n in params).sqrt(), sum(loop[n] for n in params).sqrt()
        )
    errors[TOTAL] = _relative(
        sum(f.double() for f in fast.values()).sqrt(), sum(loop.values()).sqrt()
    )
    dtype = next(engine.model.parameters()).dtype
    return CheckReport(engine.plan, errors, targets.shape[0], tolerance(dtype))


def render_plan(plan: Plan) -> Table:
    table = Table(title="plan", title_justify="left")
    for column in ("parameter", "module", "shape", "rule", "note"):
        table.add_column(column, overflow="fold")  # names stay whole, wrapped if need be
    for p in plan.params:
        table.add_row(p.name, p.module, str(tuple(p.param.shape)), p.rule, p.note)
    return table


def _error_table(title: str, errors: dict[str, float], tolerance: float) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("module")
    table.add_column("relative error", justify="right")
    for module, err in errors.items():
        table.add_row(module, f"{err:.2e}", style="" if not err > tolerance else "bold red")
    return table


def render_report(report: CheckReport) -> Group:
    parts: list[object] = [
        _error_table(f"norms, {report.examples} examples", report.errors, report.tolerance)
    ]
    explain = "norms: max|fast - loop| / max|loop|."
    if report.influence:
        parts.append(_error_table("influence", report.influence, report.tolerance))
        explain += (
            " influence: max|fast - loop| / (||g_i|| ||g_ref||), per module through the hook"
            " engine, then each engine overall (nan: forward mode cannot run this model)."
        )
    if report.non_finite:
        explain += (
            f" {report.non_finite} example(s) with a NaN or infinite loss left out: no error to"
            " measure there."
        )
    verdict = "ok" if report.ok else "FAILED"
    parts += [
        explain,
        f"worst error {report.worst:.2e} (tolerance {report.tolerance:g}): {verdict}",
    ]
    return Group(*parts)


def influence_errors(
    engine: Engine,
    inputs: tuple[Tensor, ...],
    targets: Tensor,
    ref_inputs: tuple[Tensor, ...],
    ref_targets: Tensor,
) -> dict[str, float]:
    """Worst error of both engines against the naive loop, for ``gradscope check``.

    Errors are in cosine units, max_i |fast_i - exact_i| / (||g_i|| ||g_ref||), with g_ref the
    mean-loss gradient over the reference examples: one entry per module for the hook engine
    (its share of the inner product), then ``hooks`` and ``jvp`` overall (NaN where forward mode
    fails on the model).
    """
    names = [p.name for p in engine.plan.included]
    with engine:
        _, ref_grads = naive_grads(
            engine.model, ref_inputs, ref_targets, engine.loss_fn, names, engine.forward
        )
        _, grads = naive_grads(engine.model, inputs, targets, engine.loss_fn, names, engine.forward)
        refs = reference_gradients(engine, [(ref_inputs, ref_targets)])
        hooks = engine.norms(inputs, targets, refs).inner
        forward = Influence(engine, refs, "jvp", norms=False)
        forward(inputs, targets)  # its hooks' pass proves the signature for forward mode
        jvp = forward(inputs, targets).inner[:, 0]
        if not forward.forward_mode:
            jvp = None
    g_ref = {n: g.double().mean(0).flatten() for n, g in ref_grads.items()}
    exact = {n: rows(g).double() @ g_ref[n] for n, g in grads.items()}  # (B, P) @ (P,)
    g_norm = torch.stack([rows(g).double().pow(2).sum(1) for g in grads.values()]).sum(0)
    ref_norm = torch.stack([r.pow(2).sum() for r in g_ref.values()]).sum()
    scale = (g_norm * ref_norm).sqrt().clamp_min(torch.finfo(torch.float64).tiny)

    def worst(fast: Tensor, exact_: Tensor) -> float:
        return ((fast - exact_).abs() / scale).max().item()

    errors: dict[str, float] = {}
    for module in engine.plan.modules:
        members = [p.name for p in engine.plan.included if p.module == module]
        errors[module] = worst(
            sum(hooks[n][:, 0].double() for n in members), sum(exact[n] for n in members)
        )
    exact_total = sum(exact.values())
    errors["hooks"] = worst(sum(hooks[n][:, 0].double() for n in names), exact_total)
    errors["jvp"] = float("nan") if jvp is None else worst(jvp, exact_total)
    return errors
