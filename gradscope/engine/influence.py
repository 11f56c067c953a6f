"""Influence at one checkpoint: reference gradients and the two engines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ConfigError, models_backward
from ..rules.base import rows
from .backward.reduce import Want
from .backward.stacked import laid_out
from .engine import Engine
from .jvp import JvpUnsupported, jvp_inner
from .naive import naive_grads
from .scores import total

ENGINES = ("auto", "hooks", "jvp")
MAX_PER_REF = 1000  # --per-ref holds one gradient per reference example: (K, P) floats


def reference_gradients(
    engine: Engine, batches: Iterable[tuple[tuple[Tensor, ...], Tensor]], per_ref: bool = False
) -> dict[str, Tensor]:
    """{name: (K, *shape)} over the selected parameters: the gradient of the MEAN loss over all
    batches (K = 1), or with ``per_ref`` each reference example's own gradient (K = N).

    The model must be prepared (eval mode, selected parameters requiring grad).
    """
    params = [p.param for p in engine.plan.included]
    names = [p.name for p in engine.plan.included]
    if per_ref:
        rows: dict[str, list[Tensor]] = {n: [] for n in names}
        for inputs, targets in batches:
            _, contributions = engine.contributions(inputs, targets)
            for n, p in zip(names, params, strict=True):
                c = contributions[n]
                rows[n].append(
                    c.materialize() if c is not None else p.new_zeros(targets.shape[0], *p.shape)
                )
        return {n: torch.cat(r) for n, r in rows.items()}
    sums = laid_out(params)  # (1, *shape) each, alike ones stacked for the passes to read
    count = 0
    for inputs, targets in batches:
        # the sum of per-batch sum-gradients over N is the mean-loss gradient, batch size aside
        losses = engine.losses(inputs, targets).sum()
        with models_backward():
            grads = torch.autograd.grad(losses, params, allow_unused=True)
        for t, g in zip(sums, grads, strict=True):
            if g is not None:
                t[0] += g
        count += targets.shape[0]
    for t in sums:
        t.div_(count)
    return dict(zip(names, sums, strict=True))


@dataclass
class BatchInfluence:
    """One batch scored against K reference directions at one checkpoint, in float64."""

    loss: Tensor  # (B,)
    inner: Tensor  # (B, K) <grad l_i, r_k>
    norm_sq: Tensor | None  # (B,) ||grad l_i||^2, when asked for
    observed: dict[str, Tensor] = field(default_factory=dict)  # the engine's ``observe`` columns


def check_engine(name: str) -> str:
    if name not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}", "--engine")
    return name


class Influence:
    """Scores batches against fixed reference directions ``refs`` ({name: (K, *shape)}).

    ``hooks``: the inner products come from the same factored contributions as the norms, in one
    forward+backward. ``jvp``: one forward-mode pass per direction and no backward; the norms, when
    asked for, still need the hook pass. ``auto`` takes jvp only where it saves work: one direction
    and no norms. When forward mode fails on an op it is retried once on composite attention
    (fused inference kernels step aside then), and if that fails too scoring moves to hooks;
    ``note`` says which and why.
    """

    def __init__(self, engine: Engine, refs: dict[str, Tensor], method: str, norms: bool):
        check_engine(method)
        k = next(iter(refs.values())).shape[0]
        if method == "auto":
            method = "jvp" if k == 1 and not norms else "hooks"
        self.engine, self.refs, self.method, self.norms = engine, refs, method, norms
        self._want = Want(norms=norms, refs=refs)  # the hooks' pass, asked of every batch
        self.note: str | None = None
        self._composite = False  # jvp on composite attention, see jvp_inner

    @property
    def ref_norm(self) -> Tensor:
        """(K,) the L2 norm of each reference direction over the selected parameters."""
        return (
            torch.stack([rows(r).double().pow(2).sum(1) for r in self.refs.values()]).sum(0).sqrt()
        )

    def __call__(self, inputs: tuple[Tensor, ...], targets: Tensor) -> BatchInfluence:
        while self.method == "jvp":
            try:
                loss, inner, observed = jvp_inner(
                    self.engine, inputs, targets, self.refs, self._composite
                )
            except JvpUnsupported as e:
                if self._composite:
                    self.method, self.note = "hooks", f"forward mode failed, used hooks: {e}"
                else:  # a fused inference kernel, perhaps: retry on the composite path
                    self._composite, self.note = True, f"forward mode on composite attention: {e}"
                continue
            norm_sq = None
            if self.norms:
                norm_sq = total(self.engine.norms(inputs, targets).norm_sq)
            return BatchInfluence(loss.double(), inner.double(), norm_sq, observed)
        scores = self.engine.scores(inputs, targets, self._want)
        norm_sq = total(scores.norm_sq) if self.norms else None
        return BatchInfluence(scores.loss.double(), total(scores.inner), norm_sq, scores.observed)


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
        jvp = forward(inputs, targets).inner[:, 0]
        if forward.method != "jvp":
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
