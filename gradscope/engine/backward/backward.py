"""The one backward: each captured call's (and each tap read's) output gradient handed to a
callback as it arrives, nothing kept after its step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from ...errors import models_backward
from ..capture import Call, Capture, Use


def below_targets(roots: Iterable[Node], targets: set[Node]) -> dict[Node, bool]:
    """For each of ``roots``: whether a node of ``targets`` lies strictly below it.

    Autograd runs a step of the backward only when it leads to a requested tensor, so a hooked
    output with nothing requested below it must be requested itself for its hook to fire.
    Each root's search stops at the first target it meets (most meet the layer below at once),
    and what a finished search found empty is not searched again: a replay whose reads differ
    batch to batch asks this on every batch. Iterative (graphs of deep models outgrow Python's
    recursion limit)."""
    empty: set[Node] = set()  # nodes with no target at or below them
    below: dict[Node, bool] = {}
    for root in roots:
        seen: set[Node] = set()
        stack = [child for child, _ in root.next_functions if child is not None]
        found = False
        while stack:
            node = stack.pop()
            if node in targets:
                found = True
                break
            if node in empty or node in seen:
                continue
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions if child is not None)
        if not found:
            empty |= seen
        below[root] = found
    return below


def _key(edge: GradientEdge) -> tuple[int, int]:
    return id(edge.node), edge.output_nr


@dataclass(frozen=True)
class Requests:
    """Which outputs the backward requests, by position among the calls and the reads: those
    with nothing to wait for below them (the first layer), whose steps autograd would otherwise
    skip; and of those, which hand their gradient on with no copy kept (no other hook reads
    the same output). The same for every batch whose forward runs the same ops."""

    calls: tuple[int, ...]
    reads: tuple[int, ...]
    bare_calls: frozenset[int]
    bare_reads: frozenset[int]


def requests(calls: Sequence[Call], reads: Sequence[Use], also: Sequence[Tensor]) -> Requests:
    """The ``Requests`` of a forward, read off its autograd graph."""
    nodes = [c.edge.node for c in calls]
    read_nodes = [r.edge.node for r in reads]
    leaves = [torch.autograd.graph.get_gradient_edge(t).node for t in also]
    below = below_targets([*nodes, *read_nodes], {*nodes, *read_nodes, *leaves})
    lowest = tuple(k for k, node in enumerate(nodes) if not below[node])
    lowest_reads = tuple(k for k, node in enumerate(read_nodes) if not below[node])
    # an output two hooks read (a weight-norm Linear's: its weight the tap's, its bias the
    # rule's) keeps its gradient for both: neither may zero it for the other
    seen = Counter(_key(e.edge) for e in [*calls, *reads])
    both = {key for key, n in seen.items() if n > 1}
    return Requests(
        lowest,
        lowest_reads,
        frozenset(k for k in lowest if _key(calls[k].edge) not in both),
        frozenset(k for k in lowest_reads if _key(reads[k].edge) not in both),
    )


def backward(
    capture: Capture,
    total: Tensor,
    calls: Sequence[Call],
    on_grad: Callable[[Call, Tensor], None],
    also: Sequence[Tensor] = (),
    reads: Sequence[Use] = (),
    asked: Requests | None = None,
) -> list[Tensor | None]:
    """One backward of ``total`` that hands each call's output gradient to ``on_grad`` as it
    arrives, and returns d total / d ``also`` (``None`` where ``also`` does not reach it).

    Each gradient is read in a hook on the call's output and then left to autograd, which frees
    it once the layer below has used it: no call's gradient outlives its step of the backward.
    ``asked`` (from ``requests``; read off the graph when not given) says which outputs to
    request: no parameter gradient is computed but those of ``also``. The tap's ``reads``, whose
    own hooks hand their gradients on, are waited for the same way; those requested are marked
    so, for their hooks to keep no copy either.
    """
    asked = asked if asked is not None else requests(calls, reads, also)
    for k, r in enumerate(reads):
        r.requested = k in asked.bare_reads
    bare = {id(calls[k]) for k in asked.bare_calls}
    wanted = {id(c) for c in calls}
    others = [t for c in calls for t in c.others]

    def read(call: Call, grad: Tensor | None) -> Tensor | None:
        # None: a base read for its view (capture.read_at) whose step ran for another output
        if id(call) not in wanted or grad is None:
            return None
        call.reached = True
        on_grad(call, grad if call.viewed is None else call.viewed(grad))
        # a requested call's gradient goes nowhere after this: keep no copy of it
        return grad.new_zeros(()).expand_as(grad) if id(call) in bare else None

    lowest = [calls[k].edge for k in asked.calls]
    lowest_reads = [reads[k].edge for k in asked.reads]
    capture.on_grad = read
    try:
        if not lowest and not others and not also and not lowest_reads:
            return []
        with models_backward():
            grads = torch.autograd.grad(
                total, [*lowest, *others, *also, *lowest_reads], allow_unused=True
            )
    finally:
        capture.on_grad = None
        capture.release_hooks()
    flags = iter(grads[len(lowest) : len(lowest) + len(others)])
    for call in calls:
        for _ in call.others:
            call.others_reach_loss |= next(flags) is not None
    start = len(lowest) + len(others)
    return list(grads[start : start + len(also)])
