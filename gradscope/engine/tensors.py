"""The tensors among a call's or an op's arguments and outputs, found as the analysis and the
replay must both find them: in pytree's order, without pytree's cost where the containers are
plain lists, tuples and dicts (these run on every region end and, in a region, on every op)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

_FLAT = (list, tuple)  # exactly: a namedtuple goes to pytree


def tensors_of(tree: object) -> list[Tensor]:
    """The tensors of a call's arguments or outputs, in pytree order: the analysis records a
    region's or a child's ends so, and the replay reads them so. Lists, tuples and dicts are
    walked here (in pytree's order: a dict's in insertion order), anything else by pytree,
    which costs some thirty Python calls a node (a model's output class, a namedtuple)."""
    kind = type(tree)
    if kind not in _FLAT and kind is not dict:
        if isinstance(tree, Tensor):
            return [tree]
        return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]
    found = []
    for item in tree.values() if kind is dict else tree:
        if isinstance(item, Tensor):
            found.append(item)
        elif item is not None and not isinstance(item, (int, float, bool, str)):
            found.extend(tensors_of(item))
    return found


def tensors_in(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among an op's arguments, however deep in lists, tuples and dicts
    (``torch.cat``'s): pytree only where an argument is a container (this runs on many ops)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.append(a)
        elif type(a) in _FLAT:  # torch.cat([a, b]): a list of tensors, in pytree's order
            for t in a:
                if isinstance(t, Tensor):
                    found.append(t)
                elif isinstance(t, (list, tuple, dict)):
                    found.extend(tensors_of(t))
        elif isinstance(a, (list, tuple, dict)):
            found.extend(tensors_of(a))
    return found


def flatten(args: tuple, kwargs: dict) -> tuple[list, Callable[[list], tuple[tuple, dict]]]:
    """``tree_flatten((args, kwargs))``'s leaves, and what makes the arguments again from leaves
    in their places: without pytree where no argument is a node of its (a tuple or a type it
    knows: most ops' arguments are tensors and numbers), which costs some thirty Python calls a
    node, on each op a light region follows (``derived.compute``)."""
    rest = kwargs.values()
    if any(isinstance(a, tuple) or type(a) in SUPPORTED_NODES for a in (*args, *rest)):
        flat, spec = tree_flatten((args, kwargs))
        return flat, lambda leaves: tree_unflatten(leaves, spec)
    n, keys = len(args), tuple(kwargs)
    return [*args, *rest], lambda leaves: (
        tuple(leaves[:n]),
        dict(zip(keys, leaves[n:], strict=True)),
    )
