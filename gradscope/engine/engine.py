"""The engine and its pass: a forward analysed in full or replayed, then the one backward with
the rules inside, then the fallback for what the rules cannot serve (``README.md`` draws it)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..errors import GradscopeError, ModelError, raised, stop_if_signalled
from ..losses import LossFn
from ..rules import Contribution
from .analysis import decide
from .analysis.analyse import Analysed, Analysis
from .analysis.program import program_of, regions_of, repeated, structure
from .analysis.selfcheck import Singles, first_apart, mixed
from .backward.backward import requests
from .backward.fallback import Fallback
from .backward.reduce import Reducer, Want
from .backward.serve import Served, serve, served_calls, summed, uses
from .eager import prepared
from .forward import Forward, batched
from .hooks import ModuleHooks
from .plan import FALLBACK_LOOP, build_plan
from .record import Findings, record_for
from .replay.programs import Replayed
from .replay.session import Diverged
from .scores import BatchScores, empty
from .state import State
from .steps import Program

# (selected output, targets) -> {column: (B,) tensor}: read from the scoring forward, no extra pass
Observe = Callable[[Tensor, Tensor], dict[str, Tensor]]


class Engine:
    """Per-example gradient quantities of ``model`` under ``loss_fn``: the one entry point.

    Builds the plan for the parameters ``include``/``exclude`` select (``include`` None: those
    that require grad, all if none does); ``forward`` says how the
    model is called and which output the loss reads; ``observe`` reads more per-example columns
    from the same output. Use it as a context manager around scoring: ``with engine:`` puts the
    model in eval mode with the selected parameters requiring grad and hooks the modules whose
    rules serve them (hooks that act only inside a pass), runs compiled code eagerly
    (``torch.compile`` set aside: the hooks and the trace see each op), and restores all of it
    on exit.
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
        self.plan.adopt(self.record.moves)
        self._hooks = ModuleHooks()  # on the hooked modules while the Engine is entered
        self._modules = tuple(model.modules())
        self.analysis = Analysis(
            model, self._modules, self.plan, self.record, self._losses, self._hooks
        )
        self._prepared: list[contextlib.AbstractContextManager] = []
        self._pinned: Findings | None = None  # see pin_decisions
        self.replayed = Replayed(self.plan, self.record, self._modules, self._losses, self._hooks)

    def __enter__(self) -> Engine:
        context = prepared(self.model, self.plan, self._modules)
        context.__enter__()
        self._prepared.append(context)
        self._hooks.open(self.plan.hooked_modules)
        return self

    def __exit__(self, *exc) -> None:
        if not self._prepared:  # the hooks' count untouched: the next ``with`` still hooks
            raise RuntimeError(
                "Engine.__exit__ without a matching __enter__: use `with Engine(...)`"
            )
        self._hooks.close()
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
        """One pass over a batch: the forward replayed where a program of its signature holds,
        else analysed in full; the one backward; the fallback."""
        batched(inputs, targets)
        if torch.is_inference_mode_enabled():  # no graph to take a gradient of
            what = "called inside torch.inference_mode(), where autograd records nothing"
            raise ModelError(f"{what}: call it outside", "torch.inference_mode")
        if targets.shape[0] == 0:
            return empty([p.name for p in self.plan.included], targets, want)
        self._hooked_gradients()
        findings = self._pinned or self.record.at(inputs, targets)
        if want.train:
            names = summed(self.plan, findings.formed, want.train).values()
            want = dataclasses.replace(want, summed=frozenset(names))
        passed = None if self._pinned else self.replayed(inputs, targets, want, findings)
        captured, reducer = passed or self._analysed(inputs, targets, want, findings)
        self._fallback(reducer, inputs, targets, captured.losses)
        self._fill_zeros(reducer, len(targets))
        if want.train:
            findings.formed = frozenset(reducer.formed)
        pre_sq = reducer.pre.norm_sq if reducer.pre is not None else {}
        loss = captured.losses.detach()
        return BatchScores(
            loss,
            reducer.norm_sq,
            reducer.inner,
            captured.observed,
            reducer.kept,
            pre_sq,
            reducer.gradients(),
        )

    def step(
        self, inputs: tuple[Tensor, ...], targets: Tensor, params: Sequence[Tensor]
    ) -> BatchScores:
        """A training step served with the batch's norms: the pass's one backward, of the
        summed per-example losses, also gives ``d(sum_i l_i)/dp`` of each of ``params``
        (``BatchScores.trained``; None where it does not reach the loss). ``.grad`` is left
        as it was; train/eval mode is the caller's."""
        scores = self.scores(inputs, targets, Want(norms=True, train=tuple(params)))
        if len(targets) and all(g is None for g in scores.trained):
            raise ModelError("no parameter being trained reaches the loss of the batch", "params")
        return scores

    def pin_decisions(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Findings:
        """Keep what the batch of these shapes found (scored already) for every later batch,
        whatever its shapes: no expansion test, self-check or replay runs again, so each batch
        is one forward and one backward. For a sharded model (``distributed.shard``), whose
        ranks must run the same passes, decided on the whole model first."""
        self._pinned = self.record.at(inputs, targets)
        return self._pinned

    def rebind(self) -> None:
        """Point the plan at the parameters the model holds now, by name: ``fully_shard``
        replaces each with a sharded one (the modules stay the same objects)."""
        params, self.analysis.made = dict(self.model.named_parameters()), self.analysis.made_of()
        for p in self.plan.params:
            p.param = params[p.name]

    # -- the two forwards ------------------------------------------------------------------

    def _analysed(
        self, inputs: tuple[Tensor, ...], targets: Tensor, want: Want, findings: Findings
    ) -> tuple[Analysed, Reducer]:
        """The pass with the forward analysed in full, and self-checked; its program kept
        where it holds for later batches of the signature."""
        known = [] if self._pinned else findings.checked_at()  # as the batch begins
        hooked = None if self._pinned else State(self.plan.hooked_modules)
        captured = self.analysis(inputs, targets, findings, bool(want.train))
        reads = captured.tap.reads() if captured.tap else []
        count = uses(self.plan, served_calls(self.plan, captured), reads)
        moves, program = len(self.record.moves), self._program(captured, count)
        # every analysed batch is self-checked, not only a signature's first: the trace sees no
        # op inside a hooked call, and one that runs there now (a hook added since) shows here;
        # or in its node counts, where its program's structure is one checked at this state
        verify = not (self._pinned and findings.verified) and bool(captured.losses.isfinite().all())
        if verify and repeated(program, known):
            verify, findings.repeated = False, findings.repeated + 1
        reducer, verify = self._checked(captured, want, reads, count, verify)
        findings.verified |= verify
        if len(self.record.moves) != moves:  # the program under the plan the backward left
            program = self._program(captured, count)
        kept = structure(program) if verify and not isinstance(program, str) else None
        findings.analysed(program, kept, hooked)
        return captured, reducer

    def _checked(
        self, captured: Analysed, want: Want, reads: list, count: dict[str, int], verify: bool
    ) -> tuple[Reducer, bool]:
        """The analysed batch's backward, and where ``verify``, its self-check; whether that
        ran (no example's gradient not finite)."""
        # the self-check needs every batch gradient; otherwise only those of parameters that no
        # call or read saw, to tell whether they reach the loss
        watched = self.plan.by_rule + self.plan.raw
        checked = [p for p in watched if verify or not count[p.name]]
        singles = (
            Singles(captured.losses, [p.param for p in checked]) if verify and checked else None
        )
        reducer, grads = serve(
            self.plan, captured, want, Served(count, checked, None), reads, verify
        )
        summing = verify and bool(want.train)  # the checked sums are a later step's (``serve``)
        if verify and not all(g is None or bool(g.isfinite().all()) for g in grads):
            verify = False  # an example's gradient is not finite: no check holds; the next batch
        decide.after_backward(self.plan, captured, reducer, checked, grads, singles, verify)
        if summing:  # the batch gradients a later step takes from the sums, taken so here too
            reducer.summed_at = summed(self.plan, frozenset(reducer.formed), want.train)
        return reducer, verify

    def _program(self, captured: Analysed, count: dict[str, int]) -> Program | str:
        """The replay program of an analysed batch, under the plan as it is now; or why no
        later batch may replay it."""
        regions = regions_of(captured) if not self._pinned else "pinned"
        if isinstance(regions, str):
            return regions
        watched = self.plan.by_rule + self.plan.raw
        unseen = [p for p in watched if not count[p.name]]
        uses = {p.name: count[p.name] for p in watched}
        asked = None
        if regions.fixed:  # the same calls and reads every batch: the same requests
            reads = captured.tap.timeline if captured.tap else []
            calls = served_calls(self.plan, captured)
            asked = requests(calls, reads, [p.param for p in unseen])
        checked = tuple(p.name for p in unseen)
        return program_of(captured, regions, asked, checked, uses, len(self.record.moves))

    def _hooked_gradients(self) -> None:
        """Send each parameter with a hook on its gradient (``Tensor.register_hook``: a mask,
        a scale) to the loop, the one fallback that runs the hook on each example's gradient:
        no rule, and no vmap, sees the hook."""
        for p in self.plan.included:
            if p.param._backward_hooks and p.rule != FALLBACK_LOOP:
                self.plan.to_fallback(
                    p, "a hook on its gradient, run on each example's by the loop", loop=True
                )

    # -- after the backward ----------------------------------------------------------------

    def _fallback(
        self, reducer: Reducer, inputs: tuple[Tensor, ...], targets: Tensor, losses: Tensor
    ) -> None:
        """Exact per-example gradients of the parameters no rule serves, from each example run
        alone: where one's loss alone is not its loss in the batch, the examples mix (rows one
        example's picked into another's by the batch's values) and the batch is refused."""
        names = [p.name for p in self.plan.fallback]
        loop = any(p.rule == FALLBACK_LOOP for p in self.plan.fallback)
        alone, grads = self.fallback.grads(names, inputs, targets, loop)
        if alone is not None and (i := first_apart(alone, losses)) is not None:
            raise mixed(i, alone[i].item(), losses[i].item())
        for name, dense in grads.items():
            reducer.reduce(name, dense)
        if self.fallback.vmap_error:
            for p in self.plan.fallback:
                if p.rule != FALLBACK_LOOP:
                    self.plan.to_fallback(p, f"vmap failed: {self.fallback.vmap_error}", loop=True)

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
        except (GradscopeError, Diverged):
            raise
        except Exception as e:  # whatever the user's forward raises: one line naming it
            stop_if_signalled()
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
            raise ModelError(
                f"the model cannot take inputs of shape {shapes}: {type(self.model).__name__}'s "
                f"forward raised {raised(e)}",
                "data.inputs",
            ) from e
        observed = {}
        if self.observe is not None:  # read off the output for the report: no op of the model's,
            # so none the trace or a region's mode need see (a scatter over the classes would
            # read to the trace as rows picked by value, and leave the batch without a program)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                observed = self.observe(output.detach(), targets)
        return self.loss_fn(output, targets), observed
