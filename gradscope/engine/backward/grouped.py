"""Small calls of alike modules answered together: the rule run once over their examples
stacked, where a call's few small ops cost more to dispatch than to compute (``Grouped``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ...errors import GradscopeError
from ...rules import Contribution, factored
from ...rules.base import CHUNK_ELEMENTS
from ..capture import Call, shapes_of
from ..plan import ParamPlan, Plan
from .reduce import Reducer, Want

# A call whose inputs and output gradient hold at most this many elements waits for the calls
# of modules its rule treats alike (``Rule.alike``), to be answered with them by one run.
GROUPED_ELEMENTS = 1 << 16


class Grouped:
    """Small calls held back until the backward ends, or until what they hold passes ``budget``
    elements (then those held so far are answered, and holding starts again: the calls of the layers
    the backward has passed are let go as the plain backward lets their tensors go); the calls of
    modules their rule treats alike, on inputs and output gradients of one shape, are answered by
    one run of the rule over their examples stacked, one norm and one product with the references of
    them all: the host-bound passes, where a call's rule costs more to dispatch than to compute. The
    first batch of a signature answers its calls so too, each call's sum over its examples for the
    self-check beside (every batch then rounds alike: a run sharded by FSDP, whose decisions come
    from a batch of their own, gives the bits one process gives). A call of a module holding a
    parameter that other calls serve too (merged: a module called twice, a tied weight), or whose
    rule serves it in another layout of rows or with other arguments, goes its own way at once
    (``on_grad``)."""

    def __init__(
        self,
        plan: Plan,
        merged: Sequence[str],
        on_grad: Callable[[Call, Tensor], None],
        reducer: Reducer,
        batch: int,
        budget: int = CHUNK_ELEMENTS,
    ):
        self.on_grad, self.rules, self.served = on_grad, plan.rules, plan.served
        self.reducer, self.batch, self.budget = reducer, batch, budget
        self.shared = {id(m) for p in plan.by_rule if p.name in merged for m, _ in p.owners}
        self._held: dict[tuple, list[tuple[Call, Tensor]]] = {}
        self._sizes: dict[tuple, int] = {}  # the elements each group holds
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
        ):
            self.on_grad(call, grad)
            return
        key = (rule.name, rule.alike(call.module), shapes_of(call.inputs), shapes_of((grad,)))
        self._held.setdefault(key, []).append((call, grad))
        self._sizes[key] = self._sizes.get(key, 0) + size
        self._size += size
        if self._size > self.budget:  # a pass's held calls past the budget: answered now
            self.answer()

    def answer(self) -> None:
        """Every held call answered: alone where no other is like it. The groups of several
        run smallest first, each let go once run, so a large group's stacks are made when
        little else is still held; what each gives goes to the reducer in the order the groups
        came, as if they had run in it (a sum over the parameters adds in that order)."""
        reducer, batch = self.reducer, self.batch
        several = [key for key, held in self._held.items() if len(held) > 1]
        several = sorted(several, key=self._sizes.get)
        given = {key: self._together(reducer, batch, self._held[key]) for key in several}
        for key, held in self._held.items():
            if key in given:
                given[key]()
            else:
                self.on_grad(*held[0])
        self._held.clear()
        self._sizes.clear()
        self._size = 0

    def _together(self, reducer: Reducer, batch: int, held: list) -> Callable[[], None]:
        """The calls answered by one run of their rule over their tensors stacked, the calls'
        own let go once stacked (the stack takes their place, not beside them); where the run
        fails, each call on its own with its share of the stack (each then says which module's
        rule failed). Returns what gives the answers to ``reducer``."""
        calls = [c for c, _ in held]
        inputs = tuple(torch.cat(ts) for ts in zip(*(c.inputs for c in calls), strict=True))
        for call in calls:  # before the gradients are stacked: the two stacks not at once
            call.release()
        grad = torch.cat([g for _, g in held])  # (n*B, ...)
        held.clear()
        answers = self._run(reducer, batch, calls, inputs, grad)
        if answers is not None:
            return functools.partial(_give, reducer, answers)
        n = len(calls)
        shares = [t.chunk(n) for t in inputs]  # (B, ...) views, one per call
        for k, call in enumerate(calls):
            call.inputs = tuple(share[k] for share in shares)
        return functools.partial(_alone, self.on_grad, calls, grad.chunk(n))

    def _run(
        self, reducer: Reducer, batch: int, calls: list[Call], inputs: tuple, grad: Tensor
    ) -> list[tuple] | None:
        """The rule run once over the stacked tensors: the arguments of ``reducer.answered``
        for each call's parameters, or None where it fails or a call's parameter has no
        references to stack."""
        try:
            parts = self.rules[id(calls[0].module)].fn(calls[0].module, inputs, grad)
            mine = {a: [self.served.get((id(c.module), a)) for c in calls] for a in parts}
            if reducer.want.refs is not None and any(None in ps for ps in mine.values()):
                return None  # a call's parameter not selected: no references to stack
            answers = {a: _answers(part, mine[a], reducer.want, batch) for a, part in parts.items()}
        except GradscopeError:
            raise
        except Exception:  # noqa: BLE001
            return None
        given = []
        for k in range(len(calls)):
            for attr, (norms, inners) in answers.items():
                p = mine[attr][k]
                if p is None or p.is_fallback:
                    continue
                summed = None  # its own examples' sum: for the self-check, or a step's gradient
                if reducer.want.sums or p.name in reducer.want.summed:
                    summed = _value(parts[attr].examples(k * batch, (k + 1) * batch).batch_sum())
                given.append(
                    (
                        p.name,
                        None if norms is None else norms[k],
                        None if inners is None else inners[k],
                        summed,
                    )
                )
        return given


def _give(reducer: Reducer, answers: list[tuple]) -> None:
    """A group's answers, each call's parameters', to ``reducer``."""
    for args in answers:
        reducer.answered(*args)


def _alone(on_grad: Callable[[Call, Tensor], None], calls: list[Call], grads: tuple) -> None:
    """Each call of a group whose run failed on its own, with its share of the stacks."""
    for call, grad in zip(calls, grads, strict=True):
        on_grad(call, grad)


def _value(t: Tensor) -> Callable[[], Tensor]:
    """A sum made while its group's stacks were at hand, as ``Reducer.answered`` takes one."""
    return lambda: t


def _answers(
    part: Contribution, params: list[ParamPlan | None], want: Want, batch: int
) -> tuple[Tensor | None, Tensor | None]:
    """(n, B) squared norms and (n, B, K) inner products, as ``want`` asks, of n calls'
    contributions stacked in ``part``, each call's with its parameter's references."""
    norms = part.norm_sq().view(len(params), batch) if want.norms else None
    if want.refs is None:
        return norms, None
    return norms, factored.inners(part, [want.refs[p.name] for p in params], batch)
