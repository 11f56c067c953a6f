"""``tensors.flatten``: pytree's leaves of an op's arguments, and the arguments made again from
them, as ``tree_flatten`` and ``tree_unflatten`` give them, with or without pytree."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradscope.engine.tensors import flatten

Pair = namedtuple("Pair", "a b")
t, u = torch.ones(2), torch.zeros(3)
CALLS = [
    ((t, None, None), {"training": True, "momentum": 0.0, "eps": 1e-5}),  # batch_norm's
    ((t, 1, -1), {}),
    ((t, u), {}),
    ((), {"input": t}),
    (([t, u], 0), {}),  # torch.cat's
    ((t, torch.Size([3, 2])), {}),
    ((t, Pair(u, 2)), {}),
    ((t,), {"d": OrderedDict(x=u)}),
    ((t, {"k": [u, (t,)]}), {"dtype": torch.float64}),
]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_flatten_as_pytree(args: tuple, kwargs: dict):
    leaves, again = flatten(args, kwargs)
    expected, spec = tree_flatten((args, kwargs))
    assert len(leaves) == len(expected)
    assert all(a is b for a, b in zip(leaves, expected, strict=True))
    swapped = [x + 1 if isinstance(x, torch.Tensor) else x for x in leaves]
    got, want = again(swapped), tree_unflatten(swapped, spec)
    assert tree_flatten(got)[1] == tree_flatten(want)[1]
    assert all(a is b for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0], strict=True))
