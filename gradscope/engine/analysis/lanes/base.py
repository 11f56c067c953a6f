"""What the rules of ``moves.py`` and ``computed.py`` share: a lane, and the lanes of an op's
tracked tensors read together."""

from __future__ import annotations

from torch import Tensor

Lane = tuple[int, int]  # (dim, m)


def broadcast(args: tuple, kwargs: dict, lanes: dict[int, Lane], out: Tensor) -> Lane | None:
    """An elementwise op: every tracked operand's lane, aligned to ``out``, the same one. Loops,
    not generators: the most frequent op."""
    found, seen = None, set()
    for t in (*args, *kwargs.values()) if kwargs else args:
        lane = lanes.get(id(t)) if isinstance(t, Tensor) else None
        if lane is None:
            continue
        j = lane[0] + out.dim() - t.dim()
        if j < 0 or out.shape[j] != t.shape[lane[0]] or (found and found != (j, lane[1])):
            return None
        found = (j, lane[1])
        seen.add(id(t))
    # a tracked tensor inside a list is not an elementwise operand
    return found if len(seen) == len(lanes) else None


def tracked(args: tuple, kwargs: dict, lanes: dict[int, Lane]) -> list[Tensor]:
    found = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    return [t for t in found if id(t) in lanes]


def same(items) -> Lane | None:
    """The one lane every item has, or None (an item None, or two that differ)."""
    first = None
    for lane in items:
        if lane is None or (first is not None and lane != first):
            return None
        first = lane
    return first


def aligned(t: Tensor, lane: Lane, out: Tensor) -> Lane | None:
    """``t``'s lane in ``out`` where ``t`` broadcasts to it (right-aligned), not along the lane."""
    j = lane[0] + out.dim() - t.dim()
    return (j, lane[1]) if 0 <= j < out.dim() and out.shape[j] == t.shape[lane[0]] else None


def only(args: tuple, kwargs: dict, lanes: dict[int, Lane]) -> Lane | None:
    """The lane of ``args[0]`` where it is the only tracked tensor of the op."""
    if len(lanes) != 1 or id(args[0]) not in lanes:
        return None
    return lanes[id(args[0])] if len(tracked(args, kwargs, lanes)) == 1 else None


def axis(d: object, rank: int) -> int | None:
    return d % rank if isinstance(d, int) and not isinstance(d, bool) and rank else None
