"""A watched step's random draws (``SameDraws``) where a forward raises and another is run: a
replay whose witness fails mid-forward (a batch with nothing padded after padded ones of its
shape: transformers reads ``mask.all()`` after the embeddings' dropout drew), then analysed;
the analysis's first try, where the model cannot take the expanded rows (as a multiple-choice
model, whose examples are several rows each, cannot). The generators are left where one
forward leaves them, and a run on other rows of a forward that drew refused as one that cannot
draw the batch's masks."""

from __future__ import annotations

import pytest
import torch
from oracle import trained_alike
from project import trainer_args
from torch import nn

from gradscope.engine import Drew
from gradscope.training.watchdraws import SameBuffers, SameDraws


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
    draws = SameDraws(_Once(), SameBuffers(model))
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


def test_a_trainer_whose_replay_fails_mid_forward_trains_as_without_the_watch(tmp_path):
    """BERT with dropout on rows padded to each batch's longest, some batches padding none: a
    replay of the padded batches' program fails at the unpadded one's ``mask.all()``, after
    the embeddings' dropout drew (before the fix, the step left the generators there, and the
    run ended 0.037 from the plain one)."""
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from test_watch_hf import _bert, _padded

    lengths = [6, 6, 6, 6, 6, 6, 3, 5, 6, 6, 6, 6]
    rows = [{"input_ids": [(i + t) % 31 + 1 for t in range(n)], "labels": i % 2,
             "example_id": i} for i, n in enumerate(lengths)]  # fmt: skip

    def train(callbacks: list) -> nn.Module:
        model = _bert(2)
        args = trainer_args(
            str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=3,
            learning_rate=1e-2, seed=0,
        )  # fmt: skip
        data = datasets.Dataset.from_list(rows)
        transformers.Trainer(
            model, args, train_dataset=data, data_collator=_padded, callbacks=callbacks
        ).train()
        return model

    table = trained_alike(tmp_path, train)
    assert len(table["example_id"]) == 36


class _SwitchesOnce(nn.Module):
    """A model that changes itself in its first forward, drawing a new layer's initial weights
    before its dropout draws (as BigBird's switch to full attention on short inputs does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.switched = nn.Linear(4, 3), nn.Dropout(0.5), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switched:
            self.switched = True
            nn.Linear(4, 4)  # its initial weights drawn from torch's generator
        return self.lin(self.drop(x))


def test_a_model_that_draws_more_in_its_first_forward_is_one_line(tmp_path):
    """The step's later forwards cannot draw the masks its first drew: refused, naming why."""
    from gradscope.errors import ModelError
    from gradscope.training.watch import Watch

    torch.manual_seed(0)
    model, x, y = _SwitchesOnce().double(), torch.randn(6, 4).double(), torch.arange(6) % 3
    watch = Watch(model, tmp_path / "w.parquet", "cross_entropy")
    with watch, pytest.raises(ModelError, match="drew other random numbers on another forward"):
        watch.step(x, y, torch.arange(6))
