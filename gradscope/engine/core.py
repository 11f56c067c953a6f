"""The engine and its pass: capture the forward, decide what the rules cannot serve, reduce inside
the one backward, then the fallback for the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..errors import GradscopeError, ModelError, one_line
from ..losses import LossFn
from ..rules import Contribution, Outer, find_rule
from . import decide
from .fallback import Fallback, short_reason
from .first_batch import Findings, agrees, record_for
from .forward import Forward
from .owners import regroup
from .plan import BROADCAST, FALLBACK_LOOP, ParamPlan, Plan, build_plan
from .reduce import Reducer, Want
from .session import Call, HookSession
from .tap import ParamTap, Use
from .trace import RowTrace


@dataclass
class Seen:
    """What the forward of one batch recorded."""

    session: HookSession  # the calls of the rule-served modules
    tap: ParamTap | None  # the reads of the raw parameters, when there are any
    trace: RowTrace  # which example each row of every tensor belongs to
    losses: Tensor  # (B,), graph kept
    observed: dict[str, Tensor]


# (selected output, targets) -> {column: (B,) tensor}: read from the scoring forward, no extra pass
Observe = Callable[[Tensor, Tensor], dict[str, Tensor]]


@dataclass
class BatchScores:
    """What one pass gives for a batch of B examples."""

    loss: Tensor  # (B,) each example's own loss
    norm_sq: dict[str, Tensor]  # parameter name -> (B,) squared norm of its per-example gradient
    inner: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, K) <G_i, refs[name][k]>
    observed: dict[str, Tensor] = field(default_factory=dict)  # what ``observe`` read, (B,) each
    kept: dict[str, Contribution] = field(default_factory=dict)  # with Want(keep=True)
    pre_sq: dict[str, Tensor] = field(default_factory=dict)  # with Want(transform=...): g^T P g


def _single_grads(losses: Tensor, params: Sequence[Tensor]) -> dict[int, list[Tensor | None]]:
    """The first and last examples' own gradients, each from its own backward (graph kept)."""
    picked = dict.fromkeys((0, losses.shape[0] - 1))
    return {
        i: list(torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True))
        for i in picked
    }


def _uses(plan: Plan, session: HookSession, reads: Sequence[Use]) -> dict[str, int]:
    """How many calls and reads serve each rule-served and raw parameter: one pass over the
    reads, not one per parameter (a large model has hundreds of each)."""
    count = {
        p.name: sum(len(session.calls.get(id(m), ())) for m, _ in p.owners) for p in plan.by_rule
    }
    for p in plan.raw:
        count.setdefault(p.name, 0)
    for u in reads:
        for name in dict.fromkeys(p.name for p in u.params):
            if name in count:
                count[name] += 1
    return count


def total(per_param: dict[str, Tensor]) -> Tensor:
    """The sum over parameters of per-parameter, per-example quantities, in float64."""
    return torch.stack([v.double() for v in per_param.values()]).sum(0)


@contextlib.contextmanager
def prepared(model: nn.Module, plan: Plan) -> Iterator[None]:
    """Eval mode and ``requires_grad`` on the selected parameters, restored on exit."""
    training = {m: m.training for m in model.modules()}
    requires = {id(p.param): (p.param, p.param.requires_grad) for p in plan.params}
    model.eval()
    try:
        for p in plan.included:
            p.param.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        for m, mode in training.items():  # parents first: train() sets a module's children
            if m.training != mode:
                m.train(mode)
        for p, flag in requires.values():
            p.requires_grad_(flag)


class Engine:
    """Per-example gradient quantities of ``model`` under ``loss_fn``: the one entry point.

    Builds the plan for the parameters ``include``/``exclude`` select (``include`` None: those
    that require grad, all if none does); ``forward`` says how the
    model is called and which output the loss reads; ``observe`` reads more per-example columns
    from the same output. Use it as a context manager around scoring: ``with engine:`` puts the
    model in eval mode with the selected parameters requiring grad, and restores both on exit.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        forward: Forward | None = None,
        observe: Observe | None = None,
    ):
        self.model, self.loss_fn = model, loss_fn
        self.plan = build_plan(model, include, exclude)
        self.forward = forward or Forward()
        self.observe = observe
        self.fallback = Fallback(model, loss_fn, self.forward)
        # what any pass decided holds for this model and selection, in this Engine and the next
        key = (
            frozenset(id(m) for m in self.plan.hooked_modules),
            frozenset(p.name for p in self.plan.included),
        )
        self.record = record_for(model, key)
        self.plan.replay(self.record.fallback)
        self._prepared: list[contextlib.AbstractContextManager] = []
        self._pinned: Findings | None = None  # see pin_decisions

    def __enter__(self) -> Engine:
        context = prepared(self.model, self.plan)
        context.__enter__()
        self._prepared.append(context)
        return self

    def __exit__(self, *exc) -> None:
        self._prepared.pop().__exit__(*exc)

    def losses(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """(B,) per-example losses, with the graph kept for the backward."""
        return self._losses(inputs, targets)[0]

    def norms(
        self, inputs: tuple[Tensor, ...], targets: Tensor, refs: dict[str, Tensor] | None = None
    ) -> BatchScores:
        """Losses and squared norms; with ``refs`` ({name: (K, *shape)}) also the inner products
        of each example's gradient with them, in the same forward+backward."""
        return self.scores(inputs, targets, Want(norms=True, refs=refs))

    def contributions(
        self, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Contribution | None]]:
        """Per-example losses and each included parameter's per-example gradient, factored."""
        scores = self.scores(inputs, targets, Want(norms=False, keep=True))
        return scores.loss, {p.name: scores.kept.get(p.name) for p in self.plan.included}

    def scores(self, inputs: tuple[Tensor, ...], targets: Tensor, want: Want) -> BatchScores:
        """One pass over a batch: the steps below, in order."""
        if targets.shape[0] == 0:
            return self._empty(targets)
        findings = self._pinned or self.record.at(inputs)
        seen = self._capture(inputs, targets, findings)
        decide.before_backward(self.plan, seen)
        reducer = self._reduce_in_backward(seen, want, findings)
        self._fallback(reducer, inputs, targets)
        self._fill_zeros(reducer, seen.losses.shape[0])
        loss = seen.losses.detach()
        pre_sq = reducer.pre.norm_sq if reducer.pre is not None else {}
        return BatchScores(
            loss, reducer.norm_sq, reducer.inner, seen.observed, reducer.kept, pre_sq
        )

    def pin_decisions(self, inputs: tuple[Tensor, ...]) -> Findings:
        """Keep what the batch of ``inputs``' shapes found (scored already) for every later
        batch, whatever its shapes: no expansion test or self-check runs again, so each
        batch is one forward and one backward. For a sharded model (``distributed.shard``),
        whose ranks must run the same passes, decided on the whole model first."""
        self._pinned = self.record.at(inputs)
        return self._pinned

    def rebind(self) -> None:
        """Point the plan at the parameters the model holds now, by name: ``fully_shard``
        replaces each with a sharded one (the modules stay the same objects)."""
        params = dict(self.model.named_parameters())
        for p in self.plan.params:
            p.param = params[p.name]

    # -- the steps -------------------------------------------------------------------------

    def _capture(self, inputs: tuple[Tensor, ...], targets: Tensor, findings: Findings) -> Seen:
        """The forward with every call of the rule-served modules recorded, and every op on the
        raw parameters watched.

        Calls on rows shared by the batch get them expanded to the batch, once the first batch
        has shown that this leaves every loss as it was; that first comparison with the model as
        written also refuses a model whose forward is random. A model that edits a captured
        tensor in place is run again with copies of the edited modules' tensors.
        """
        while True:
            expand = findings.expand is not False
            try:
                seen = self._recorded(inputs, targets, expand, findings.assume)
            except ModelError:
                if not expand:
                    raise
                findings.expand = False  # the model cannot take the expanded rows: run as is
                continue
            expanded = seen.session.expanded or (seen.tap is not None and seen.tap.expanded)
            if findings.expand is None or findings.deterministic is None:
                same = self._same_losses(inputs, targets, seen.losses)
                if expanded and not same:
                    findings.expand = False  # the expanded rows changed a loss: run as is
                    continue
                findings.expand = findings.expand if findings.expand is False else expand
                if not same:
                    raise ModelError(
                        "the model gives other losses for the same batch on a second forward "
                        "(random masking or noise in eval mode?): per-example gradients of a "
                        "random function are not defined; make its forward deterministic",
                        "model",
                    )
                findings.deterministic = True
            if expanded and not seen.trace.per_example(seen.losses, len(targets)):
                # the model read one example's copy of the expanded rows for all (Swin V2's
                # position-bias table): the losses mix; run as is
                findings.expand = False
                continue
            assumed = seen.session.assumed or (seen.tap is not None and seen.tap.assumed)
            if assumed and not seen.trace.per_example(seen.losses, len(targets)):
                findings.assume = False  # a call's rows were shared after all: run as is
                continue
            edited = seen.session.edited_in_place() - self.record.copy
            if not edited:
                return seen
            self.record.copy |= edited  # capture copies from now on, and redo this batch

    def _recorded(
        self, inputs: tuple[Tensor, ...], targets: Tensor, expand: bool, assume: bool
    ) -> Seen:
        watched, batch = self.plan.by_rule + self.plan.raw, targets.shape[0]
        trace = RowTrace(batch, (*inputs, targets))
        session = HookSession(self.plan.hooked_modules, trace, self.record.copy, expand, assume)

        def ruled(p: ParamPlan) -> bool:  # read in a call of its rule's module: the rule's
            return p.rule != BROADCAST and any(session.inside(m) for m, _ in p.owners)

        # a rule-served parameter read outside its module's calls (nn.MultiheadAttention's
        # out_proj) is served where a function reads it, as a raw one is
        tap = ParamTap(watched, batch, trace, ruled, expand, assume) if watched else None
        # with every parameter on the fallback, this pass only gives the losses: no graph
        with (
            torch.set_grad_enabled(bool(watched)),
            session,
            trace,
            tap or contextlib.nullcontext(),
        ):
            losses, observed = self._losses(inputs, targets)
        return Seen(session, tap, trace, losses, observed)

    def _same_losses(self, inputs: tuple[Tensor, ...], targets: Tensor, losses: Tensor) -> bool:
        """Whether the model as written gives the losses the expanded calls gave."""
        with torch.no_grad():
            plain = self._losses(inputs, targets)[0]
        return plain.shape == losses.shape and agrees(losses.detach(), plain)

    def _reduce_in_backward(self, seen: Seen, want: Want, findings: Findings) -> Reducer:
        """One backward; each call's rule runs as its output gradient arrives, and only what
        ``want`` asks for is kept. On the first batch, each rule's gradients are also summed
        over the examples and checked against autograd's batch gradient, and two examples'
        norms against their own backward."""
        session, losses = seen.session, seen.losses
        served = {(id(m), attr): p for p in self.plan.by_rule for m, attr in p.owners}
        modules = {module for module, _ in served}
        calls = [c for c in session.all_calls() if id(c.module) in modules]
        reads = seen.tap.reads() if seen.tap else []
        count = _uses(self.plan, session, reads)
        verify = not findings.verified and bool(losses.isfinite().all())
        merged = [name for name, k in count.items() if k > 1]
        # the self-check compares sums over the batch, and single examples' norms
        reducer = Reducer(
            dataclasses.replace(
                want, norms=want.norms or verify, share=want.share and want.norms, sums=verify
            ),
            merged,
        )
        if not count:
            return reducer
        # the self-check needs every batch gradient; otherwise only those of parameters that no
        # call or read saw, to tell whether they reach the loss
        checked = [p for p in self.plan.by_rule + self.plan.raw if verify or not count[p.name]]
        singles = _single_grads(losses, [p.param for p in checked]) if verify else {}
        on_grad = functools.partial(self._on_grad, served, reducer, losses.shape[0])

        def on_read(use: Use, grad: Tensor) -> None:
            use.reached = True
            try:
                parts = use.parts(grad)
            except Exception as e:  # a computed read torch.func cannot differentiate
                for p in use.params:
                    if not p.is_fallback:
                        self.plan.to_fallback(p, f"its read failed: {short_reason(e)}")
                return
            for name, part in parts.items():
                if not self.plan.find(name).is_fallback:
                    reducer.add(name, part)

        if seen.tap:
            seen.tap.reading(on_read)
        try:
            grads = session.backward(
                losses.sum(), calls, on_grad, [p.param for p in checked], reads
            )
        finally:
            if seen.tap:
                seen.tap.reading(None)
        reducer.finish()
        decide.after_backward(self.plan, seen, reducer, checked, grads, singles, verify)
        if verify:
            findings.verified = True
        return reducer

    def _on_grad(self, served: dict, reducer: Reducer, batch: int, call: Call, grad: Tensor):
        """A call's output gradient has arrived: its rule's contributions go to ``reducer``."""
        inputs, counts = call.inputs, None
        if call.rows is not None:  # rows in another layout: each example's rows gathered
            (x, grad), counts = regroup(call.rows, batch, inputs[0], grad)
            inputs = (x, *inputs[1:])
        try:
            parts = find_rule(call.module).fn(call.module, inputs, grad, **call.kwargs)
            if counts is not None:  # a row-by-row rule: an Outer's positions are the rows
                parts = {k: _padded(part, counts, grad.shape[1]) for k, part in parts.items()}
        except GradscopeError:
            raise  # a rule's refusal (BatchNorm on batch statistics) is the user's to fix
        except Exception as e:  # a layer recognised wrongly: its rule declines
            for (module, _), p in served.items():
                if module == id(call.module) and not p.is_fallback:
                    self.plan.to_fallback(p, f"its rule failed: {short_reason(e)}")
            return
        finally:
            call.release()
        for attr, part in parts.items():
            p = served.get((id(call.module), attr))
            if p is not None and not p.is_fallback:
                reducer.add(p.name, part)

    def _fallback(self, reducer: Reducer, inputs: tuple[Tensor, ...], targets: Tensor) -> None:
        """Exact per-example gradients of the parameters no rule serves."""
        names = [p.name for p in self.plan.fallback]
        for name, dense in self.fallback.grads(names, inputs, targets).items():
            reducer.reduce(name, dense)
        if self.fallback.vmap_error:
            for p in self.plan.fallback:
                if p.rule != FALLBACK_LOOP:
                    self.plan.to_fallback(p, f"vmap failed: {self.fallback.vmap_error}", loop=True)

    def _empty(self, targets: Tensor) -> BatchScores:
        """An empty batch: empty scores, no pass."""
        none = targets.new_zeros(0, dtype=torch.float64)
        return BatchScores(none, {p.name: none for p in self.plan.included})

    def _fill_zeros(self, reducer: Reducer, batch: int) -> None:
        """Zeros for the rule-served parameters that no call of this batch reached."""
        for p in self.plan.by_rule + self.plan.raw:
            reducer.zeros(p.name, batch, p.param)

    def _losses(
        self, inputs: tuple[Tensor, ...], targets: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(B,) losses and what ``observe`` reads from the same output."""
        try:
            output = self.forward(self.model, inputs)
        except GradscopeError:
            raise
        except Exception as e:  # whatever the user's forward raises: one line naming it
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            raise ModelError(
                f"the model cannot take inputs of shape {shapes}: {type(self.model).__name__}'s "
                f"forward raised {type(e).__name__}: {one_line(e)}",
                "data.inputs",
            ) from e
        observed = {}
        if self.observe is not None:
            with torch.no_grad():
                observed = self.observe(output.detach(), targets)
        return self.loss_fn(output, targets), observed


def _padded(part: Contribution, counts: list[int], longest: int) -> Contribution:
    """``part`` told how many of its positions each example's rows fill, where it is an Outer
    over the (B, L) rows a row-by-row rule got gathered and padded: a padded row's output
    gradient is zero, and so is its term (``Outer.lengths``)."""
    if isinstance(part, Outer) and part.lengths is None and part.dims[2] == longest:
        return Outer(part.s, part.a, part.shape, counts)
    return part
