"""The watch of a class id per token, unshifted: a token classifier's, a masked and a seq2seq
language model's loss, the mean over the batch's counted tokens, under dropout, on batches
padded to their longest row (labels -100 where padded, as ``DataCollatorForTokenClassification``
and ``DataCollatorForSeq2Seq`` pad)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from oracle import trained_alike, watched_as_looped
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradscope.errors import ConfigError, ModelError  # noqa: E402
from gradscope.training.watch_hf import WatchCallback  # noqa: E402

KEYWORDS = ("input_ids", "attention_mask")
KINDS = {  # each kind's model class, and its number of classes a token
    "token": ("BertForTokenClassification", 3),
    "masked": ("BertForMaskedLM", 32),
}


def _model(kind: str) -> torch.nn.Module:
    """A one-layer BERT of ``kind`` with its dropout on (0.1, in its layers and attention)."""
    name, classes = KINDS[kind]
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=classes,
    )  # fmt: skip
    return getattr(transformers, name)(config).double().train()


def _rows(kind: str) -> list[dict]:
    """Rows of 2 to 6 tokens, a label a token (a masked LM's: -100 but where masked), one
    token of the third row not counted."""
    classes, rows = KINDS[kind][1], []
    for i, n in enumerate([6, 3, 5, 4, 2, 6, 3, 5]):
        labels = [(t * 7 + i) % classes for t in range(n)]
        if kind == "masked":
            labels = [y if (t + i) % 3 == 0 else -100 for t, y in enumerate(labels)]
        rows.append({"input_ids": list(range(1, n + 1)), "labels": labels, "example_id": i})
    rows[2]["labels"][0] = -100
    return rows


def _padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A batch padded to its longest row, the padding's labels -100."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {k: torch.full((len(rows), longest), v, dtype=torch.long)
             for k, v in (("input_ids", 0), ("attention_mask", 0), ("labels", -100))}  # fmt: skip
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :n] = torch.tensor(r["labels"])
    batch["example_id"] = torch.tensor([r["example_id"] for r in rows])
    return batch


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_row_is_its_counted_tokens_mean_under_the_batchs_masks(tmp_path, kind):
    """Each row's loss, norm, margin and correct are those of the mean over its own counted
    tokens under the batch's dropout masks; ``.grad`` the step's mean over every counted
    token, on the analysed batch and the replayed one."""
    plain, rows = _model(kind), _rows(kind)[:4]
    moved = [{**r, "input_ids": [t + 10 for t in r["input_ids"]]} for r in rows]  # other values
    batches = [(tuple(b[k] for k in KEYWORDS), b["labels"]) for b in map(_padded, (rows, moved))]
    table = watched_as_looped(
        _model(kind), plain, tmp_path / "w.parquet", batches, _token_losses(plain),
        loss="cross_entropy", reduction="tokens", keywords=KEYWORDS, output="logits",
    )  # fmt: skip
    (first, _), (inputs, y) = batches
    with torch.no_grad():  # the second step's rows: its masks drawn again from where it began
        torch.manual_seed(3)
        plain(*first)
        logits = plain(*inputs).logits
    counted = y != -100
    loss = [F.cross_entropy(logits[i], y[i]).item() for i in range(4)]
    right = [(logits[i].argmax(-1) == y[i])[counted[i]].double().mean().item() for i in range(4)]
    np.testing.assert_allclose(table["loss"][4:], loss, rtol=1e-10)
    np.testing.assert_allclose(table["prob"][4:], np.exp(-np.array(loss)), rtol=1e-10)
    np.testing.assert_allclose(table["correct"][4:], right, rtol=1e-12)
    assert np.isfinite(table["margin"]).all()


def _token_losses(plain: torch.nn.Module):
    """A batch's losses: each row's mean over its counted tokens, and the batch's over all."""

    def losses(inputs: tuple, y: torch.Tensor) -> tuple:
        every = y.flatten()
        return (lambda i: F.cross_entropy(plain(*inputs).logits[i], y[i]),
                lambda: F.cross_entropy(plain(*inputs).logits.flatten(0, 1), every))  # fmt: skip

    return losses


def _trainer(tmp_path, kind: str, callbacks: list, accumulate: int = 1):
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4 // accumulate, num_train_epochs=2,
        gradient_accumulation_steps=accumulate, learning_rate=1e-2, seed=0,
    )  # fmt: skip
    model, data = _model(kind), datasets.Dataset.from_list(_rows(kind))
    trainer = transformers.Trainer(
        model, args, train_dataset=data, data_collator=_padded, callbacks=callbacks
    )
    return model, trainer


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_trainer_of_a_label_a_token_trains_as_without_the_watch(tmp_path, kind):
    """A token classifier's and a masked LM's Trainer, dropout on, batches padded to their
    longest row: the watched run's weights are the plain run's (the loss over the counted
    tokens, unshifted), and each row is written at each step (a masked LM's row 4 masks none
    of its tokens: no loss, no share correct, no gradient)."""

    def train(callbacks: list) -> torch.nn.Module:
        model, trainer = _trainer(tmp_path, kind, callbacks)
        trainer.train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    none = np.array(table["example_id"]) == (4 if kind == "masked" else -1)
    assert np.isfinite(table["grad_norm"]).all()
    np.testing.assert_array_equal(np.isnan(table["correct"]), none)
    np.testing.assert_array_equal(np.isnan(table["loss"]), none)
    assert (np.array(table["grad_norm"])[none] == 0).all()


def test_a_token_classifier_under_accumulation_is_one_line(tmp_path):
    """Accumulated, which of a micro-batch's mean and the step's sum over its counted tokens a
    token classifier takes is its class's (BERT's: the micro-batch's)."""
    callback = WatchCallback(tmp_path / "w.parquet")
    model, trainer = _trainer(tmp_path, "token", [callback], accumulate=2)
    with pytest.raises(ConfigError, match="gradient accumulation") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


def _seq2seq(name: str, attention: str = "eager") -> torch.nn.Module:
    """A one-layer BART or T5 with its dropout on (0.1)."""
    torch.manual_seed(0)
    if name == "bart":
        config = transformers.BartConfig(
            vocab_size=32, d_model=8, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
            decoder_ffn_dim=16, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=2, attn_implementation=attention,
        )  # fmt: skip
        return transformers.BartForConditionalGeneration(config).double().train()
    config = transformers.T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation=attention,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config).double().train()


def _pairs() -> list[dict]:
    """Sources of 2 to 6 tokens, targets of 2 to 4."""
    return [{"input_ids": list(range(3, 3 + n)), "labels": list(range(10, 12 + n % 3)),
             "example_id": i} for i, n in enumerate([6, 3, 5, 4, 2, 6, 3, 5])]  # fmt: skip


def _pairs_padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Sources padded with 0, targets with -100, each to the batch's longest."""
    longest = max(len(r["labels"]) for r in rows)
    labels = torch.full((len(rows), longest), -100)
    for i, r in enumerate(rows):
        labels[i, : len(r["labels"])] = torch.tensor(r["labels"])
    sources = _padded([{**r, "labels": [0] * len(r["input_ids"])} for r in rows])
    return {**sources, "labels": labels}


def test_a_seq2seq_rows_norm_is_its_target_tokens_mean_under_the_batchs_masks(tmp_path):
    """BART, its decoder inputs its labels shifted right as its forward shifts them: each
    row's loss and norm those of the mean over its own counted target tokens."""
    plain, batches = _seq2seq("bart"), []
    for pairs in (_pairs()[:4], _pairs()[4:]):  # one shape, other values
        batch = _pairs_padded(pairs)
        decoder = plain.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        inputs = (batch["input_ids"], batch["attention_mask"], decoder)
        batches.append((inputs, batch["labels"]))
    watched_as_looped(
        _seq2seq("bart"), plain, tmp_path / "w.parquet", batches, _token_losses(plain),
        loss="cross_entropy", reduction="tokens", keywords=(*KEYWORDS, "decoder_input_ids"),
        output="logits",
    )  # fmt: skip


def _seq2seq_trainer(tmp_path, model, callbacks):
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, seed=0,
    )  # fmt: skip
    return transformers.Trainer(
        model, args, train_dataset=datasets.Dataset.from_list(_pairs()),
        data_collator=_pairs_padded, callbacks=callbacks,
    )  # fmt: skip


def test_t5s_fused_attention_under_dropout_is_one_line(tmp_path):
    """T5's position bias read by the fused attention, whose dropout no rule sees: its
    examples would run alone, which cannot draw the batch's masks."""
    model = _seq2seq("t5", "sdpa")
    trainer = _seq2seq_trainer(tmp_path, model, [WatchCallback(tmp_path / "w.parquet")])
    with pytest.raises(ModelError, match="cannot draw the masks the batch drew") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_a_seq2seq_trainer_trains_as_without_the_watch(tmp_path, name):
    """BART's and T5's (eager attention) Trainer, dropout on, sources and targets padded: the
    watched run's weights are the plain run's. A batch without decoder inputs gets them made
    of its labels, as the model's forward makes them."""

    def train(callbacks: list) -> torch.nn.Module:
        model = _seq2seq(name)
        _seq2seq_trainer(tmp_path, model, callbacks).train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
