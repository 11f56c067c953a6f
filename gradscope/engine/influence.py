"""Influence at one checkpoint: reference gradients and the two engines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import ConfigError, DataError, models_backward
from ..rules import Outer
from ..rules.base import rows
from ..rules.factored import Factored, Reference, cheaper, dense
from .backward.reduce import Want
from .backward.stacked import laid_out
from .engine import Engine
from .jvp import JvpUnsupported, jvp_inner
from .proven import proven
from .scores import total

ENGINES = ("auto", "hooks", "jvp")
MAX_PER_REF = 1000  # --per-ref holds one gradient per reference example: (K, P) floats


def reference_gradients(
    engine: Engine,
    batches: Iterable[tuple[tuple[Tensor, ...], Tensor]],
    per_ref: bool = False,
    factored: bool = False,
) -> dict[str, Reference]:
    """{name: (K, *shape)} over the selected parameters: the gradient of the MEAN loss over all
    batches (K = 1), or with ``per_ref`` each reference example's own gradient (K = N).

    ``factored``: the directions of a weight an Outer serves (Linear, Conv) kept as the sums of
    the reference pass's outer products (``rules.factored.Factored``) where the inner products
    with them cost less than through R formed (``rules.factored.cheaper``, for an example of
    the reference's positions); the rest formed. The model must be prepared (eval mode, selected
    parameters requiring grad).
    """
    if per_ref:
        return _per_ref(engine, batches, factored)
    if factored:
        return _factored_mean(engine, batches)
    params = [p.param for p in engine.plan.included]
    names = [p.name for p in engine.plan.included]
    sums = laid_out(params)  # (1, *shape) each, alike ones stacked for the passes to read
    count = 0
    for inputs, targets in batches:
        # the sum of per-batch sum-gradients over N is the mean-loss gradient, batch size aside
        losses = engine.losses(inputs, targets)
        _finite_rows(losses, count)
        with models_backward():
            grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        for t, g in zip(sums, grads, strict=True):
            if g is not None:
                t[0] += g
        count += targets.shape[0]
    for t in sums:
        t.div_(_counted(count))
    return dict(zip(names, sums, strict=True))


def _factored_mean(
    engine: Engine, batches: Iterable[tuple[tuple[Tensor, ...], Tensor]]
) -> dict[str, Reference]:
    """The mean-loss gradient from the contributions of each batch's pass: an Outer's positions
    kept (those whose output gradient is not zero: a padding token's is) while they cost less
    than R formed (``rules.factored.cheaper``), formed and summed from the batch where they stop
    or a contribution of another kind comes; the rest summed as formed (``batch_sum``)."""
    included = engine.plan.included
    sums = laid_out([p.param for p in included])  # (1, *shape) each, as the formed mean's
    held: dict[str, list | None] = {p.name: [] for p in included}  # None: formed from now on
    first: dict[str, Outer] = {}
    count = 0
    for inputs, targets in batches:
        losses, contributions = engine.contributions(inputs, targets)
        _finite_rows(losses, count)
        for p, total_ in zip(included, sums, strict=True):
            c, pieces = contributions[p.name], held[p.name]
            if c is None:
                continue
            if pieces is not None and type(c) is Outer and _alike(c, first.get(p.name, c)):
                pieces.append(_positions(c))
                # one example's copy for its layout: the batch's tensors are let go
                one = first.setdefault(p.name, Outer(c.s[:1].clone(), c.a[:1].clone(), c.shape))
                if cheaper(one, 1, sum(u.shape[1] for u, _ in pieces), each=True):
                    continue
                total_[0] += _factors(pieces, one.shape).dense()[0]
            else:
                if pieces:
                    total_[0] += _factors(pieces, first[p.name].shape).dense()[0]
                total_[0] += c.batch_sum()
            held[p.name] = None
        count += targets.shape[0]
    count = _counted(count)
    out: dict[str, Reference] = {}
    for p, total_ in zip(included, sums, strict=True):
        if held[p.name]:
            kept = _factors(held[p.name], first[p.name].shape)
            out[p.name] = Factored(kept.u / count, kept.v, kept.param_shape)
        else:
            out[p.name] = total_.div_(count)
    return out


def _finite_rows(losses: Tensor, first: int) -> None:
    """Each row of a mean reference's batch (its rows from ``first`` on) has a finite loss: one
    that has not (a NaN or inf in its inputs or target) makes the mean gradient NaN, and with
    it every example's score."""
    rows = non_finite_rows(losses, first)
    if rows:
        raise DataError(
            f"the reference's row {rows}: its loss is not finite (a NaN or inf in its inputs or "
            "target?), so the mean gradient over the reference, and every example's score "
            "against it, would be NaN; leave it out, or score each row with --per-ref",
            "ref",
        )


def non_finite_rows(losses: Tensor, first: int) -> str | None:
    """The rows (counted from ``first``) whose loss is not finite, as an error lists them (five
    at most); None where every one is."""
    bad = (~losses.detach().isfinite()).nonzero().flatten().tolist()
    if not bad:
        return None
    return ", ".join(str(first + i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")


def _counted(count: int) -> int:
    """The reference's examples, where it has any: a mean over none is no direction."""
    if not count:
        raise DataError("the reference has no examples: no gradient to score against", "ref")
    return count


def _alike(c: Outer, other: Outer) -> bool:
    """Whether two Outers hold positions of one layout: groups, outputs, inputs."""
    return c.dims[1:2] + c.dims[3:] == other.dims[1:2] + other.dims[3:]


def _positions(c: Outer) -> tuple[Tensor, Tensor]:
    """(G, M, O) output gradients and (G, M, I) inputs of the batch's positions whose output
    gradient is not zero in every group (the rest add nothing to its gradient)."""
    nonzero = c.s.ne(0).any(-1).any(1)  # (B, T)
    return c.s.transpose(0, 1)[:, nonzero], c.a.transpose(0, 1)[:, nonzero]


def _factors(pieces: list[tuple[Tensor, Tensor]], shape: torch.Size) -> Factored:
    """One direction, the sum over every piece's positions."""
    u = torch.cat([u for u, _ in pieces], 1)[None]  # (1, G, N, O)
    return Factored(u, torch.cat([v for _, v in pieces], 1)[None], shape)  # v (1, G, N, I)


def _per_ref(
    engine: Engine, batches: Iterable[tuple[tuple[Tensor, ...], Tensor]], factored: bool
) -> dict[str, Reference]:
    """Each reference example's own gradient, from the contributions of its batch's pass: an
    Outer's kept as its factors (each example's positions, padded to the longest) where
    ``factored`` and they cost less."""
    parts: dict[str, list] = {p.name: [] for p in engine.plan.included}
    for inputs, targets in batches:
        _, contributions = engine.contributions(inputs, targets)
        for p in engine.plan.included:
            c = contributions[p.name]
            if c is None:
                c = p.param.new_zeros(targets.shape[0], *p.param.shape)
            elif not (factored and type(c) is Outer):
                c = c.materialize()
            parts[p.name].append(c)
    return {name: _joined(held) for name, held in parts.items()}


def _joined(parts: list) -> Reference:
    """One parameter's per-reference gradients of every batch, (K, *shape) formed or, where
    each batch's is an Outer of one layout and that costs less, factored."""
    if all(type(c) is Outer for c in parts) and len({c.dims[1:2] + c.dims[3:] for c in parts}) == 1:
        t = max(c.dims[2] for c in parts)
        pad = [(0, 0, 0, t - c.dims[2]) for c in parts]  # zero positions at the end: no term
        u = torch.cat([F.pad(c.s, p) for c, p in zip(parts, pad, strict=True)])  # (K, G, T, O)
        v = torch.cat([F.pad(c.a, p) for c, p in zip(parts, pad, strict=True)])  # (K, G, T, I)
        kept = Factored(u, v, parts[0].shape)
        if cheaper(parts[0], len(kept), t, each=True):
            return kept
        return kept.dense()
    return torch.cat([c.materialize() if isinstance(c, Outer) else c for c in parts])


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
    and no norms. Forward mode scores only a batch of a signature this scorer's hooks pass
    proved (``proven``), the model in the state the proof holds at (its hooks included): any
    other batch, a signature's first included, is scored by the hooks. When forward mode fails
    on an op it is retried once on composite attention (fused inference kernels step aside
    then), and if that fails too scoring moves to hooks; ``note`` says which and why.
    """

    def __init__(self, engine: Engine, refs: dict[str, Reference], method: str, norms: bool):
        check_engine(method)
        k = len(next(iter(refs.values())))
        if method == "auto":
            method = "jvp" if k == 1 and not norms else "hooks"
        self.engine, self.refs, self.method, self.norms = engine, refs, method, norms
        self._want = Want(norms=norms, refs=refs)  # the hooks' pass, asked of every batch
        self.note: str | None = None
        self._composite = False  # jvp on composite attention, see jvp_inner
        self.forward_mode = False  # whether the last batch was scored by forward mode
        # the ids of the signatures' findings this scorer's hooks pass proved (``proven``):
        # forward mode scores their batches while the proof holds
        self._proven: set[int] = set()

    @property
    def ref_norm(self) -> Tensor:
        """(K,) the L2 norm of each reference direction over the selected parameters."""
        return torch.stack([_sq_norms(r) for r in self.refs.values()]).sum(0).sqrt()

    def __call__(self, inputs: tuple[Tensor, ...], targets: Tensor) -> BatchInfluence:
        self.forward_mode = False
        findings = self.engine.record.at(inputs, targets)
        while self.method == "jvp" and id(findings) in self._proven and proven(findings):
            try:
                tangents = {n: dense(r) for n, r in self.refs.items()}  # formed once each
                loss, inner, observed = jvp_inner(
                    self.engine, inputs, targets, tangents, self._composite
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
            self.forward_mode = True
            return BatchInfluence(loss.double(), inner.double(), norm_sq, observed)
        scores = self.engine.scores(inputs, targets, self._want)
        if self.method == "jvp" and proven(findings):
            self._proven.add(id(findings))
        norm_sq = total(scores.norm_sq) if self.norms else None
        return BatchInfluence(scores.loss.double(), total(scores.inner), norm_sq, scores.observed)


def _sq_norms(ref: Reference) -> Tensor:
    """(K,) ||r_k||^2 in float64: of the factors in float64 where it is factored."""
    if isinstance(ref, Factored):
        return Factored(ref.u.double(), ref.v.double(), ref.param_shape).norm_sq()
    return rows(ref).double().pow(2).sum(1)
