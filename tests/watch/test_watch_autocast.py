"""The watch of a float32 model whose forward computes in bfloat16 (autocast, as a ``Trainer``
with ``bf16=True`` runs it): its checks compare at bfloat16's rounding, so no parameter leaves
its rule and no example runs alone for rounding's sake, and a model that mixes its examples is
still refused."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from oracle import redrawn_norms
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradscope.engine import computed_in  # noqa: E402
from gradscope.errors import ModelError, RecordWarning  # noqa: E402
from gradscope.training.watch import Watch  # noqa: E402
from gradscope.training.watch_hf import WatchCallback  # noqa: E402

KEYWORDS = ("input_ids", "attention_mask")


def _bert() -> torch.nn.Module:
    """A float32 BERT classifier with its dropout on (0.1, in its layers and attention)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=2,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).train()


def _padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A batch padded to its longest row, which alone skips the attention mask."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.zeros(len(rows), longest, dtype=torch.long) for k in KEYWORDS}
    for i, r in enumerate(rows):
        batch["input_ids"][i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        batch["attention_mask"][i, : len(r["input_ids"])] = 1
    batch["labels"] = torch.tensor([r["labels"] for r in rows])
    batch["example_id"] = torch.tensor([r["example_id"] for r in rows])
    return batch


ROWS = [{"input_ids": list(range(1, n + 1)), "labels": n % 2, "example_id": i}
        for i, n in enumerate([6, 3, 5, 4, 2, 6, 3, 5])]  # fmt: skip


def _logits(model, inputs):
    with torch.autocast("cpu", torch.bfloat16):
        return model(*inputs).logits.float()


def test_under_autocast_each_norm_is_the_bfloat16_loops(tmp_path):
    """Each row's norm is its loss's under the batch's masks, in a loop that computes in
    bfloat16 too, far within bfloat16's rounding; ``.grad`` the plain step's; no parameter on
    the fallback; and the next pass in float32 compares at float32's rounding again."""
    model, plain = _bert(), _bert()
    batches = [_padded(ROWS[:4]), _padded(ROWS[4:])]  # one shape, other values
    steps = [(tuple(b[k] for k in KEYWORDS), b["labels"]) for b in batches]
    torch.manual_seed(3)
    with Watch(model, tmp_path / "w.parquet", keywords=KEYWORDS, output="logits") as watch:
        for inputs, y in steps:
            with torch.autocast("cpu", torch.bfloat16):
                watch.step(inputs, y, torch.arange(4)).backward()
            assert computed_in() == torch.bfloat16
        assert not watch.engine.plan.fallback
        model.eval()
        watch.engine.norms(inputs, y)  # float32 throughout
        assert computed_in() is None
    norms = redrawn_norms(plain, 4, [
        (lambda i, x=x, y=y: F.cross_entropy(_logits(plain, x)[i], y[i]),
         lambda x=x, y=y: F.cross_entropy(_logits(plain, x), y)) for x, y in steps
    ])  # fmt: skip
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=1e-3)


def test_under_autocast_a_loss_that_mixes_the_examples_is_refused(tmp_path):
    """A loss that mixes the batch's examples by more than bfloat16's rounding is refused
    (one that moves a loss by less, 0.4%, no check in bfloat16 can tell from rounding)."""

    def mixing(outputs, targets):
        losses = F.cross_entropy(outputs, targets, reduction="none")
        return losses - losses.mean()

    batch = _padded(ROWS[:4])
    inputs = tuple(batch[k] for k in KEYWORDS)
    model = _bert().eval()  # no dropout: its examples run alone to check
    with (
        Watch(model, tmp_path / "w.parquet", mixing, keywords=KEYWORDS, output="logits") as w,
        torch.autocast("cpu", torch.bfloat16),
        pytest.raises(ModelError, match="mixes"),
    ):
        w.step(inputs, batch["labels"], batch["example_id"])


def _trained(tmp_path, bf16: bool, callbacks: list) -> torch.Tensor:
    """The weights a Trainer's SGD leaves after two epochs of batches of four."""
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2, optim="sgd",
        learning_rate=0.5, seed=0, bf16=bf16,
    )  # fmt: skip
    model, data = _bert(), datasets.Dataset.from_list(ROWS)
    transformers.Trainer(
        model, args, train_dataset=data, data_collator=_padded, callbacks=callbacks
    ).train()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_bf16_trainer_with_dropout_trains_as_without_the_watch(tmp_path):
    """``bf16=True``, dropout on, batches padded to their longest row (it was refused: the
    check at float32's rounding found bfloat16's, and ran examples alone): the watched run's
    weights are the plain bf16 run's up to bfloat16's rounding of a gradient, which moves
    them as little as computing in bfloat16 at all does."""
    watched = _trained(tmp_path, True, [WatchCallback(tmp_path / "w.parquet")])
    plain, full = _trained(tmp_path, True, []), _trained(tmp_path, False, [])
    assert (watched - plain).abs().max() < 5 * (plain - full).abs().max()
    assert (watched - plain).abs().max() < 1e-3 < (plain - _bert_weights()).abs().max()
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)


def _bert_weights() -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in _bert().parameters()])


def test_a_bf16_trainers_record_is_refused_by_the_replay(tmp_path):
    """Autocast entered inside the model's call (accelerate's wrapper) is not on where the
    record looks, but its layers' bfloat16 shows: the record names it, not a float32 replay of
    another run than the one trained."""
    import json

    record = tmp_path / "bf16.run"
    with pytest.warns(RecordWarning, match="will not replay: step 0 ran under autocast"):
        _trained(tmp_path, True, [WatchCallback(tmp_path / "w.parquet", record=record)])
    refused = json.loads((record / "record.json").read_text())["refused"]
    assert refused == "step 0 ran under autocast: the replay computes in the config's dtype"
