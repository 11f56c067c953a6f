"""Reading the autograd graph: which steps of the backward lead to a requested tensor, and
where a call's output gradient can be read."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from torch import Tensor
from torch.autograd.graph import Node


def read_at(
    out: Tensor, inputs: Sequence[object]
) -> tuple[Tensor, Callable[[Tensor], Tensor] | None]:
    """The tensor whose gradient gives ``out``'s, and how (None: as it is). ``out`` itself;
    or, where ``out`` is a view of a tensor the call made (a float64 Linear's (B, T, out) view
    of its (B*T, out) product, einsum's permuted product), that tensor, its gradient viewed as
    ``out``: an in-place edit of a view of it later (``h += e``, ``x[..., :n] *= m``) takes the
    view's own node out of the backward, not its base's. Not where the base is one of the
    call's inputs (a view of what was passed in: its gradient holds other uses too)."""
    base = out._base
    if (
        base is None
        or not base.is_contiguous()
        or any(t is base or getattr(t, "_base", None) is base for t in inputs)
    ):
        return out, None
    size, stride = out.size(), out.stride()
    offset = out.storage_offset() - base.storage_offset()
    return base, lambda grad: grad.contiguous().as_strided(size, stride, offset)


def below_targets(roots: Iterable[Node], targets: set[Node]) -> dict[Node, bool]:
    """For every node at or under ``roots``: whether a node of ``targets`` lies strictly below it.

    Autograd runs a step of the backward only when it leads to a requested tensor, so a hooked
    output with nothing requested below it must be requested itself for its hook to fire.
    Iterative (graphs of deep models outgrow Python's recursion limit); each node is read once.
    """
    below: dict[Node, bool] = {}
    children: dict[Node, list[Node]] = {}  # each node's read once: a new tuple on every read
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            below[node] = any(child in targets or below[child] for child in children[node])
        elif node not in below:
            below[node] = False  # visited; the graph has no cycles, so no child waits on it
            kids = children[node] = [child for child, _ in node.next_functions if child is not None]
            stack.append((node, True))
            stack.extend((child, False) for child in kids if child not in below)
    return below
