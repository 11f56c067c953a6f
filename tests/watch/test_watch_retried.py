"""A watched step's random draws (``SameDraws``) where the analysis's first forward raises and
is tried again (a model that cannot take the expanded rows, as a multiple-choice model, whose
examples are several rows each, cannot): the generators left where one forward leaves them,
and a run on other rows of a forward that drew refused as one that cannot draw the batch's
masks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradscope.engine import Drew
from gradscope.training.watchdraws import SameDraws


class _Once:
    """A forward (dropout) whose first call raises before it draws, as a try of the analysis's
    that the model refuses does."""

    def __init__(self):
        self.raised = False

    def __call__(self, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not self.raised:
            self.raised = True
            raise ValueError("cannot take the expanded rows")
        return model(*inputs)


def test_a_forward_that_raised_first_leaves_the_generators_where_one_forward_does():
    model, x = nn.Dropout(0.5).train(), torch.ones(4, 8)
    torch.manual_seed(0)
    expected = model(x)
    after = torch.get_rng_state()
    draws = SameDraws(_Once())
    torch.manual_seed(0)
    draws.begin()
    with pytest.raises(ValueError):
        draws(model, (x,))
    torch.testing.assert_close(draws(model, (x,)), expected)  # the batch's masks
    with pytest.raises(Drew):  # an example alone cannot draw them
        draws(model, (x[:1],))
    torch.testing.assert_close(draws(model, (x,)), expected)  # again, from where it began
    draws.end()
    assert torch.equal(torch.get_rng_state(), after)
