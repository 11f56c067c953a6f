"""The rules inside the one backward: each served call's rule, and each tap read's parts, run as
their output gradient arrives, and what they give goes to the reducer; a rule that fails sends
its parameters to the fallback with the reason."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import GradscopeError
from ...rules import Contribution, Outer, find_rule
from ...rules.base import CHUNK_ELEMENTS
from ..capture import Call, Captured, shapes_of
from ..plan import ParamPlan, Plan
from ..rows import regroup
from .backward import Requests, backward
from .fallback import short_reason
from .reduce import Reducer, Want

if TYPE_CHECKING:
    from ..analysis.tap import Use


@dataclass
class Served:
    """What one backward needs beside the captured forward: from the analysis as it goes, or
    from the program a replay repeats."""

    count: dict[str, int]  # calls and reads serving each watched parameter
    checked: list[ParamPlan]  # parameters whose batch gradients are asked for
    asked: Requests | None  # which outputs to request; None: read off this batch's graph


def served_calls(plan: Plan, captured: Captured) -> list[Call]:
    """The captured calls of modules whose rules serve a parameter, in capture order."""
    modules = {module for module, _ in plan.served}
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


def serve(
    plan: Plan,
    captured: Captured,
    want: Want,
    done: Served,
    reads: Sequence[Use] = (),
    verify: bool = False,
) -> tuple[Reducer, list[Tensor | None]]:
    """One backward; each call's rule runs as its output gradient arrives, and only what
    ``want`` asks for is kept. With ``verify`` (a signature's first batch) each rule's
    gradients are also summed over the examples, for the self-check. Returns the reducer and
    the batch gradients of ``done.checked``."""
    merged = [name for name, k in done.count.items() if k > 1]
    reducer = Reducer(
        dataclasses.replace(
            want, norms=want.norms or verify, share=want.share and want.norms, sums=verify
        ),
        merged,
    )
    if not done.count and not done.checked:  # every parameter on the fallback
        reducer.finish()
        return reducer, []
    served = plan.served
    batch = captured.losses.shape[0]
    on_grad = functools.partial(_on_grad, plan, served, reducer, batch)
    grouped = Grouped(plan, merged, on_grad) if _groupable(reducer.want) else None
    if captured.tap:
        captured.tap.reading(functools.partial(_on_read, plan, reducer))
    also = [p.param for p in done.checked]
    calls = served_calls(plan, captured)
    try:
        grads = backward(
            captured.session,
            captured.losses.sum(),
            calls,
            on_grad if grouped is None else grouped.take,
            also,
            reads,
            done.asked,
        )
    finally:
        if captured.tap:
            captured.tap.reading(None)
    if grouped is not None:
        grouped.answer(served, reducer, batch)
    reducer.finish()
    return reducer, grads


def _groupable(want: Want) -> bool:
    """Whether a pass asks of each contribution only what a group of calls answers together:
    squared norms, inner products with references and, on a signature's first batch, the
    sums over the examples for the self-check."""
    return not want.keep and want.transform is None and want.project is None


# A call whose inputs and output gradient hold at most this many elements waits for the calls
# of modules its rule treats alike (``Rule.alike``), to be answered with them by one run.
GROUPED_ELEMENTS = 1 << 16


class Grouped:
    """Small calls held back until the backward ends; then the calls of modules their rule
    treats alike, on inputs and output gradients of one shape, are answered by one run of the
    rule over their examples stacked, one norm and one product with the references of them all:
    the host-bound passes, where a call's rule costs more to dispatch than to compute. The first
    batch of a signature answers its calls so too, each call's sum over its examples for the
    self-check beside (every batch then rounds alike: a run sharded by FSDP, whose decisions
    come from a batch of their own, gives the bits one process gives). A call of a module
    holding a parameter that other calls serve too (merged: a module called twice, a tied
    weight), or whose rule serves it in another layout of rows or with other arguments, goes
    its own way at once (``on_grad``)."""

    def __init__(self, plan: Plan, merged: Sequence[str], on_grad):
        self.on_grad, self.rules = on_grad, plan.rules
        self.shared = {id(m) for p in plan.by_rule if p.name in merged for m, _ in p.owners}
        self._held: dict[tuple, list[tuple[Call, Tensor]]] = {}
        self._size = 0

    def take(self, call: Call, grad: Tensor) -> None:
        rule, inputs = self.rules.get(id(call.module)), call.inputs
        size = grad.numel() + (
            inputs[0].numel() if len(inputs) == 1 else sum(t.numel() for t in inputs)
        )
        if (
            rule is None
            or rule.alike is None
            or call.rows is not None
            or call.kwargs
            or id(call.module) in self.shared
            or size > GROUPED_ELEMENTS
            or self._size + size > CHUNK_ELEMENTS
        ):
            self.on_grad(call, grad)
            return
        key = (rule.name, rule.alike(call.module), shapes_of(call.inputs), shapes_of((grad,)))
        self._held.setdefault(key, []).append((call, grad))
        self._size += size

    def answer(self, served: dict, reducer: Reducer, batch: int) -> None:
        """Every held call answered: alone where no other is like it."""
        for held in self._held.values():
            if len(held) == 1 or not self._together(served, reducer, batch, held):
                for call, grad in held:
                    self.on_grad(call, grad)
        self._held.clear()

    def _together(self, served: dict, reducer: Reducer, batch: int, held: list) -> bool:
        """The calls answered by one run of their rule, or False where it fails (each call on
        its own then says which module's rule failed)."""
        calls = [c for c, _ in held]
        inputs = tuple(torch.cat(ts) for ts in zip(*(c.inputs for c in calls), strict=True))
        grad = torch.cat([g for _, g in held])  # (n*B, ...)
        try:
            parts = self.rules[id(calls[0].module)].fn(calls[0].module, inputs, grad)
            mine = {a: [served.get((id(c.module), a)) for c in calls] for a in parts}
            if reducer.want.refs is not None and any(None in ps for ps in mine.values()):
                return False  # a call's parameter not selected: no references to stack
            answers = {a: _answers(part, mine[a], reducer.want, batch) for a, part in parts.items()}
        except GradscopeError:
            raise
        except Exception:  # noqa: BLE001
            return False
        for k, call in enumerate(calls):
            for attr, (norms, inners) in answers.items():
                p = mine[attr][k]
                if p is None or p.is_fallback:
                    continue
                summed = None  # the call's own examples' sum, where the self-check asks for it
                if reducer.want.sums:
                    summed = parts[attr].examples(k * batch, (k + 1) * batch).batch_sum
                reducer.answered(
                    p.name,
                    None if norms is None else norms[k],
                    None if inners is None else inners[k],
                    summed,
                )
            call.release()
        return True


def _answers(
    part: Contribution, params: list[ParamPlan | None], want: Want, batch: int
) -> tuple[Tensor | None, Tensor | None]:
    """(n, B) squared norms and (n, B, K) inner products, as ``want`` asks, of n calls'
    contributions stacked in ``part``, each call's with its parameter's references."""
    norms = part.norm_sq().view(len(params), batch) if want.norms else None
    if want.refs is None:
        return norms, None
    return norms, part.inners(torch.stack([want.refs[p.name] for p in params]), batch)


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
