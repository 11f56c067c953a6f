"""The watch as a Hugging Face Trainer callback: the run it serves trains as it would
without it, and writes a row per example and step."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradscope.training.watch_hf import WatchCallback  # noqa: E402


def _run(tmp_path, callbacks, accumulate=1):
    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, **no_dropout
    )
    model = transformers.GPT2LMHeadModel(config).double()
    tokens = torch.randint(0, 16, (8, 6))
    labels = tokens.clone()
    labels[1, 3:] = -100
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens.tolist(), "labels": labels.tolist(), "example_id": list(range(8))}
    )
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=4 // accumulate,
        gradient_accumulation_steps=accumulate, num_train_epochs=2, learning_rate=1e-2,
        remove_unused_columns=False, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, seed=0, data_seed=0, eval_strategy="epoch",
    )  # fmt: skip
    trainer = transformers.Trainer(
        model, args, train_dataset=data, eval_dataset=data.select(range(4)), callbacks=callbacks
    )
    trainer.train()
    return model, trainer


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_trains_as_without_the_watch_and_writes_each_step(tmp_path, accumulate):
    plain, _ = _run(tmp_path, [], accumulate)
    out = tmp_path / "w.parquet"
    watched, trainer = _run(tmp_path, [WatchCallback(out)], accumulate)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        # the Trainer's loss takes the logits in float32: equal to its rounding
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert "forward" not in watched.__dict__  # the model's own forward again
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals)  # evaluated mid-training
    table = pq.read_table(out).to_pydict()
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    assert table["epoch"] == [0] * 8 + [1] * 8
    assert len(set(table["step"])) == 4 * accumulate
