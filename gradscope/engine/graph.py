"""Reading the autograd graph: which steps of the backward lead to a requested tensor."""

from __future__ import annotations

from collections.abc import Iterable

from torch.autograd.graph import Node


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
