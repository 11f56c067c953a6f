"""The rules inside the one backward: each served call's rule, and each tap read's parts, run as
their output gradient arrives, and what they give goes to the reducer; a rule that fails sends
its parameters to the fallback with the reason."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from torch.nn import Parameter

from ...errors import GradscopeError
from ...rules import Contribution, Outer, find_rule
from ..capture import Call, Captured, Use
from ..plan import ParamPlan, Plan
from ..rows import regroup
from .backward import Requests, backward, requests
from .fallback import short_reason
from .grouped import Grouped
from .reduce import Reducer, Want


@dataclass
class Served:
    """What one backward needs beside the captured forward: from the analysis as it goes, or
    from the program a replay repeats."""

    count: dict[str, int]  # calls and reads serving each watched parameter
    checked: list[ParamPlan]  # parameters whose batch gradients are asked for
    asked: Requests | None  # which outputs to request; None: read off this batch's graph
    # a training step's requests, by the ids of the tensors asked of autograd, kept across
    # batches where ``asked`` holds for every batch of the program (``Program.trained``)
    trained: dict[tuple[int, ...], Requests] | None = None


def served_calls(plan: Plan, captured: Captured) -> list[Call]:
    """The captured calls of modules whose rules serve a parameter, in capture order."""
    modules = plan.serving
    return [c for c in captured.session.all_calls() if id(c.module) in modules]


def uses(plan: Plan, calls: Sequence[Call], reads: Sequence[Use]) -> dict[str, int]:
    """How many calls and reads serve each rule-served and raw parameter: one pass over the
    calls and the reads, not one per parameter (a large model has hundreds of each)."""
    per_module = Counter(id(c.module) for c in calls)
    count = {p.name: sum(per_module[id(m)] for m, _ in p.owners) for p in plan.by_rule}
    for p in plan.raw:
        count.setdefault(p.name, 0)
    for u in reads:
        for name in dict.fromkeys(p.name for p in u.params):
            if name in count:
                count[name] += 1
    return count


def held_budget(calls: Sequence[Call]) -> int:
    """The elements a pass holds back to answer together at most, ``Grouped``'s calls and the
    reducer's small parts each: a quarter of what the served calls' inputs and outputs hold.
    The plain backward's peak is near its start, where it holds most of those (a layer's
    output is the next op's input) and the parameters' gradients; the held calls' inputs are
    among them, and what the pass adds to its peak is their output gradients and the stacks
    a group's run makes. A quarter keeps the host and tiny workloads' peaks within 1.2x the
    plain backward's at the fewest runs: a third did at a batch of 4, where the parameters'
    gradients are most of the peak, not at 16 (H5, whose every call is small: 1.23x)."""
    return sum(c.shape.numel() + sum(t.numel() for t in c.inputs) for c in calls) // 4


def summed(plan: Plan, formed: frozenset[str] | None, train: Sequence[Tensor]) -> dict[int, str]:
    """The parameters of ``train`` whose batch gradient a training step takes from their
    rules' sums (``Want.summed``), by their positions in ``train`` (``Reducer.summed_at``):
    those whose rules ``formed`` each example's gradient on the signature's last step (the same
    shapes form again; where one does not, its sum is one product, as autograd's), served by
    rules or reads still and not sharded (the examples' sum is not a shard's). ``formed`` None:
    every one that may be."""
    names = {
        id(p.param): p.name
        for p in plan.by_rule + plan.raw
        if (formed is None or p.name in formed) and type(p.param) in (Tensor, Parameter)
    }
    return {k: names[id(t)] for k, t in enumerate(train) if id(t) in names}


def serve(
    plan: Plan,
    captured: Captured,
    want: Want,
    done: Served,
    reads: Sequence[Use] = (),
    verify: bool = False,
) -> tuple[Reducer, list[Tensor | None]]:
    """One backward; each call's rule runs as its output gradient arrives, and only what
    ``want`` asks for is kept. With ``verify`` (a batch analysed in full) each rule's
    gradients are also summed over the examples, for the self-check: on a training step, each
    as a later step sums it (``Want.summed``), while its batch gradient stays autograd's
    (``Engine._checked`` takes the sums after the check). Returns the reducer and the batch
    gradients of ``done.checked``."""
    merged = [name for name, k in done.count.items() if k > 1]
    want = _kept(plan, want, verify)
    reducer = Reducer(want, merged)
    if not done.count and not done.checked and not want.train:  # all on the fallback
        reducer.finish()
        return reducer, []
    served = plan.served
    batch = captured.losses.shape[0]
    on_grad = functools.partial(_on_grad, plan, served, reducer, batch)
    calls = served_calls(plan, captured)
    grouped = _holding(plan, merged, on_grad, reducer, batch, calls)
    if captured.tap:
        captured.tap.reading(functools.partial(_on_read, plan, reducer))
    also = [p.param for p in done.checked]
    # a training step's gradients come from the same backward, autograd's but for those the
    # rules sum (``Reducer.gradients``)
    at = {} if verify else summed(plan, reducer.want.summed, want.train)
    ruled = {id(want.train[k]) for k in at}
    auto = [t for t in want.train if id(t) not in ruled]
    asked = done.asked if not want.train else _trained(done, calls, reads, [*also, *auto])
    try:
        grads = backward(
            captured.session,
            captured.losses.sum(),
            calls,
            on_grad if grouped is None else grouped.take,
            [*also, *auto],
            reads,
            asked,
        )
    finally:
        if captured.tap:
            captured.tap.reading(None)
    if grouped is not None:
        grouped.answer()
    reducer.finish()
    by_autograd = iter(grads[len(also) :])
    reducer.trained = [None if id(t) in ruled else next(by_autograd) for t in want.train]
    reducer.summed_at = at
    return reducer, grads[: len(also)]


def _kept(plan: Plan, want: Want, verify: bool) -> Want:
    """What the backward keeps of ``want``: a verified batch's norms and sums too, for the
    self-check, summed as a later step sums them; its inner products not shared with norms
    that only the self-check asks, so that they round as on every other batch (a pass without
    norms shares nothing: ``want`` as it came)."""
    if not (verify or want.sums):
        return want
    return dataclasses.replace(
        want,
        norms=want.norms or verify,
        share=want.share and want.norms,
        sums=verify,
        summed=frozenset(summed(plan, None, want.train).values()) if verify else want.summed,
    )


def _trained(
    done: Served, calls: Sequence[Call], reads: Sequence[Use], tensors: list[Tensor]
) -> Requests | None:
    """A training step's requests: read off this graph (a program's own leave the parameters'
    steps out, which a training step asks for), once for the program where its requests hold
    for every batch; None: read off by ``backward``."""
    if done.trained is None:
        return None
    key = tuple(id(t) for t in tensors)
    if (asked := done.trained.get(key)) is None:
        asked = done.trained[key] = requests(calls, reads, tensors)
    return asked


def _holding(
    plan: Plan, merged: list[str], on_grad, reducer: Reducer, batch: int, calls: Sequence[Call]
) -> Grouped | None:
    """The pass's budget (``held_budget``) set for ``reducer``'s held parts, and the
    ``Grouped`` that holds its small calls under the same, where the pass asks what a group
    answers and the plan has modules alike (``Plan.alike``)."""
    budget = held_budget(calls)
    reducer.hold(budget, plan.alike)
    if not _groupable(reducer.want) or not plan.alike:  # nothing to group: no call held
        return None
    return Grouped(plan, merged, on_grad, reducer, batch, budget)


def _groupable(want: Want) -> bool:
    """Whether a pass asks of each contribution only what a group of calls answers together:
    squared norms, inner products with references and, on a batch analysed in full, the
    sums over the examples for the self-check."""
    return not want.keep and want.transform is None and want.project is None


def _on_read(plan: Plan, reducer: Reducer, use: Use, grad: Tensor) -> None:
    """A tap read's output gradient has arrived: its parameters' contributions."""
    use.reached = True
    try:
        parts = use.parts(grad)
    except Exception as e:  # a computed read torch.func cannot differentiate
        for p in use.params:
            if not p.is_fallback:
                plan.to_fallback(p, f"its read failed: {short_reason(e)}")
        return
    for name, part in parts.items():
        if not plan.find(name).is_fallback:
            reducer.add(name, part)


def _on_grad(
    plan: Plan, served: dict, reducer: Reducer, batch: int, call: Call, grad: Tensor
) -> None:
    """A call's output gradient has arrived: its rule's contributions go to ``reducer``."""
    inputs, counts = call.inputs, None
    if call.rows is not None:  # rows in another layout: each example's rows gathered
        (x, grad), counts = regroup(call.rows, batch, inputs[0], grad)
        inputs = (x, *inputs[1:])
    try:
        rule = plan.rules.get(id(call.module)) or find_rule(call.module)
        parts = rule.fn(call.module, inputs, grad, **call.kwargs)
        if counts is not None:  # a row-by-row rule: an Outer's positions are the rows
            parts = {k: _padded(part, counts, grad.shape[1]) for k, part in parts.items()}
    except GradscopeError:
        raise  # a rule's refusal (BatchNorm on batch statistics) is the user's to fix
    except Exception as e:  # a layer recognised wrongly: its rule declines
        for (module, _), p in served.items():
            if module == id(call.module) and not p.is_fallback:
                plan.to_fallback(p, f"its rule failed: {short_reason(e)}")
        return
    finally:
        call.release()
    for attr, part in parts.items():
        p = served.get((id(call.module), attr))
        if p is not None and not p.is_fallback:
            reducer.add(p.name, part)


def _padded(part: Contribution, counts: list[int], longest: int) -> Contribution:
    """``part`` told how many of its positions each example's rows fill, where it is an Outer
    over the (B, L) rows a row-by-row rule got gathered and padded: a padded row's output
    gradient is zero, and so is its term (``Outer.lengths``)."""
    if isinstance(part, Outer) and part.lengths is None and part.dims[2] == longest:
        return Outer(part.s, part.a, part.shape, counts)
    return part
