"""A watched loop whose loss is the mean over each step's counted tokens, its rows counting
different numbers of them (padding, -100), as a ``Trainer`` fine-tunes a language model: its
record replays, each row weighed by its share of the step's tokens, to the finite differences
of that loop (each row's tokens weighed 1 +- eps, the same start and order), in float64."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from gradscope.config import load_config
from gradscope.losses import resolve_loss
from gradscope.training.replay import through_training
from gradscope.training.watch import Watch
from tests.project import trainer_args
from tests.training.test_through_training import close

transformers = pytest.importorskip("transformers")

# eager attention: sdpa's has no double backward on the CPU
GPT2 = {"vocab_size": 16, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "attn_implementation": "eager"}  # fmt: skip
BATCHES = [torch.arange(0, 4), torch.arange(4, 8), torch.arange(2, 6)]  # twice: six steps
CLIP = 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows of six tokens; three end in padding (labels -100): 5, 3 and 2 counted."""
    tokens = torch.randint(1, 16, (8, 6), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[1, 5:], labels[4, 3:], labels[6, 2:] = -100, -100, -100
    return tokens, labels


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).double()


def _train(weights: torch.Tensor | None = None, watch: dict | None = None) -> torch.nn.Module:
    """SGD with momentum and weight decay over the batches twice, clipped; the loss the sum of
    each row's counted tokens' losses times its weight, over the step's counted tokens: through
    the watch, or by hand. (Not Adam: its normalisation of GPT-2's gradients near zero makes
    the loop linear in a row's weight only very near 1: with AdamW, central differences at
    1e-5 read 0.65 apart from the replay, at 1e-7 6e-5.)"""
    tokens, labels = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=0.01)
    watched = None
    if watch is not None:
        watched = Watch(model, watch["out"], "causal_lm", reduction="tokens", output="logits",
                        record=watch["record"], optimizer=optimizer, clip=CLIP).__enter__()  # fmt: skip
    for rows in BATCHES * 2:
        optimizer.zero_grad()
        if watched is not None:
            watched.step((tokens[rows],), labels[rows], rows).backward()
        else:
            logits, target = model(tokens[rows]).logits[:, :-1], labels[rows][:, 1:]
            per_token = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            summed = (per_token.sum(1) * weights[rows]).sum()
            (summed / (target != -100).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    if watched is not None:
        watched.__exit__(None, None, None)
    return model


def _reference_loss(model: torch.nn.Module, ref: dict) -> float:
    """The mean over the references of each one's own loss, the mean over its tokens."""
    logits = model(ref["ids"]).logits
    return resolve_loss("causal_lm")(logits, ref["labels"]).mean().item()


def test_a_token_mean_over_rows_of_unequal_counts_replays_to_finite_differences(tmp_path):
    tokens, labels = _data()
    torch.save({"ids": tokens, "labels": labels}, tmp_path / "data.pt")
    ref_tokens = torch.randint(1, 16, (2, 6), generator=torch.Generator().manual_seed(2))
    ref = {"ids": ref_tokens, "labels": ref_tokens.clone()}
    ref["labels"][1, 4:] = -100
    torch.save(ref, tmp_path / "ref.pt")
    config = {
        "model": {"factory": "transformers:GPT2LMHeadModel", "config": GPT2},
        "data": {"path": "data.pt", "inputs": "ids", "targets": "labels", "batch_size": 4},
        "loss": {"name": "causal_lm"},
        "dtype": "float64",
        "device": "cpu",
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    _train(watch={"out": tmp_path / "w.parquet", "record": tmp_path / "w.run"})
    meta = json.loads((tmp_path / "w.run" / "record.json").read_text())
    assert meta["refused"] is None and meta["tokens"] is True
    got = through_training(load_config(tmp_path / "config.yaml"), tmp_path / "w.run",
                           tmp_path / "ref.pt")  # fmt: skip
    eps, want = 1e-5, []
    for i in range(8):
        e = torch.zeros(8, dtype=torch.float64)
        e[i] = eps
        up, down = (_reference_loss(_train(1 + s * e), ref) for s in (1, -1))
        want.append(-(up - down) / (2 * eps))
    assert close(got, np.array(want))


def test_a_trainers_dynamically_padded_run_replays_from_a_ragged_dataset(tmp_path):
    """A Trainer's language model on rows padded to each batch's longest (labels -100,
    dropout on), its record replayed from the rows as a ragged dataset that ``data.pad``
    pads per batch alike, the config naming its inputs in another order than the collator
    passed them (they are compared by name). The replay's own check holds: every segment
    recomputed reaches the weights the run reached."""
    datasets = pytest.importorskip("datasets")
    from gradscope.training.watch_hf import WatchCallback

    lengths = [6, 3, 5, 4, 2, 6, 3, 5]
    rows = [{"input_ids": list(range(1, n + 1)), "attention_mask": [1] * n,
             "labels": list(range(1, n + 1))} for n in lengths]  # fmt: skip
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))

    def padded(batch: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(b["input_ids"]) for b in batch)
        out = {"input_ids": torch.zeros(len(batch), longest, dtype=torch.long)}
        out["attention_mask"] = torch.zeros_like(out["input_ids"])
        out["labels"] = torch.full_like(out["input_ids"], -100)
        for i, b in enumerate(batch):
            for key in out:
                out[key][i, : len(b[key])] = torch.tensor(b[key])
        return {**out, "example_id": torch.tensor([b["example_id"] for b in batch])}

    config = {**GPT2, "resid_pdrop": 0.1}
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).double()
    model.loss_type = "ForCausalLM"  # the Trainer counts the next tokens it divides by
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
                        optim="sgd", learning_rate=0.1, seed=0)  # fmt: skip
    train = datasets.Dataset.from_list([{**r, "example_id": i} for i, r in enumerate(rows)])
    callback = WatchCallback(tmp_path / "w.parquet", record=tmp_path / "w.run", segment=2)
    transformers.Trainer(
        model, args, train_dataset=train, data_collator=padded, callbacks=[callback]
    ).train()
    meta = json.loads((tmp_path / "w.run" / "record.json").read_text())
    assert meta["refused"] is None and meta["tokens"] is True
    assert meta["inputs"] == ["input_ids", "attention_mask"]
    torch.save({"input_ids": torch.tensor([[3, 4, 5, 6]]), "attention_mask": torch.ones(1, 4),
                "labels": torch.tensor([[3, 4, 5, 6]])}, tmp_path / "ref.pt")  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model": {"factory": "transformers:GPT2LMHeadModel", "config": config},
        "data": {"path": "data", "targets": "labels", "pad": {"input_ids": 0}, "batch_size": 4,
                 "inputs": {"attention_mask": "attention_mask", "input_ids": "input_ids"}},
        "loss": {"name": "causal_lm"}, "dtype": "float64", "device": "cpu",
    }, sort_keys=False))  # fmt: skip
    got = through_training(load_config(tmp_path / "config.yaml"), tmp_path / "w.run",
                           tmp_path / "ref.pt")  # fmt: skip
    assert got.shape == (8,) and np.isfinite(got).all() and np.abs(got).max() > 0
