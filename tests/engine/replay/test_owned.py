"""Each example's own value of a branch on the batch's values, read off the tensor reduced
(``analysis/branches.py``'s ``own``, ``replay/owned.py``) instead of running each example alone
to the branch: what it reduces by example, and where it declines (None: the examples run)."""

from __future__ import annotations

import torch

from gradscope.engine.analysis.branches import _apart, own
from gradscope.engine.analysis.owners import NONE, batch_owner
from gradscope.engine.replay.owned import Owned


def mask() -> torch.Tensor:
    m = torch.ones(3, 4, dtype=torch.bool)
    m[1, 2:] = False
    return m


def test_each_example_s_own_all_and_any():
    m, owners = mask(), batch_owner(3, 2, torch.device("cpu"))
    assert own(m, owners, "all", 3).tolist() == [True, False, True]
    assert own(~m, owners, "any", 3).tolist() == [False, True, False]


def test_declined_where_an_element_is_no_example_s_or_an_example_has_none():
    owners = batch_owner(3, 2, torch.device("cpu"))
    assert _apart(owners, torch.Size([3, 4]), 3) is owners
    shared = owners.expand(3, 4).clone()
    shared[:, 0] = NONE  # a column of the model's own: each example alone has it too
    assert _apart(shared, torch.Size([3, 4]), 3) is None
    assert _apart(owners[:2], torch.Size([2, 4]), 3) is None  # example 2 owns nothing


def test_a_witness_keeps_what_was_reduced_up_to_the_read():
    """``mask.all()`` and transformers' ``fast_all`` (``mask.sum() == mask.numel()``) read off
    the mask; a read of a tensor the witness did not see reduced gives None."""
    m, owners = mask(), batch_owner(3, 2, torch.device("cpu"))
    hosts = [("__bool__", False, (owners, "all"))] * 3
    values: list = []
    owned = Owned(hosts, 3, values)
    owned.read(0, owned.reduce(torch.Tensor.all, (m,), {}))
    total = owned.reduce(torch.Tensor.sum, (m,), {})
    owned.read(1, owned.reduce(torch.Tensor.__eq__, (total, m.numel()), {}))
    owned.read(2, m.all())
    assert [v.tolist() for v in values[:2]] == [[True, False, True]] * 2
    assert values[2] is None
