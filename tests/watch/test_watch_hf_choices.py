"""The watch of a multiple-choice model (each example several rows, one a choice: the cross
entropy of its choice) and of a question answerer (the mean of its start's and its end's cross
entropy, as transformers' own loss), dropout on, batches padded: each row's norm the loop's
under the batch's masks, and the ``Trainer`` runs train as without the watch."""

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
CHOICES, TOKENS = 3, 6


def _model(kind: str) -> torch.nn.Module:
    """A one-layer BERT of ``kind`` with its dropout on (0.1, in its layers and attention)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8,
    )  # fmt: skip
    return getattr(transformers, f"BertFor{kind}")(config).double().train()


def _rows(kind: str) -> list[dict]:
    """Eight rows, some padded: a multiple-choice row's choices of 3 to 6 tokens each; a
    question answerer's row of 3 to 6 tokens, its answer's start and end among them."""
    rows = []
    for i in range(8):
        if kind == "MultipleChoice":
            lengths = [TOKENS - (i + c) % 4 for c in range(CHOICES)]
            ids = [[(i + c + t) % 31 + 1 for t in range(TOKENS)] for c in range(CHOICES)]
            mask = [[int(t < n) for t in range(TOKENS)] for n in lengths]
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": i % CHOICES})
        else:
            n = TOKENS - i % 4
            ids, mask = (
                [(i * 5 + t) % 31 + 1 for t in range(TOKENS)],
                [int(t < n) for t in range(TOKENS)],
            )
            start = i % n
            rows.append({"input_ids": ids, "attention_mask": mask, "start_positions": start,
                         "end_positions": min(start + 1, n - 1)})  # fmt: skip
        rows[-1]["example_id"] = i
    return rows


def _batch(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def _choice_losses(plain: torch.nn.Module):
    def losses(inputs: tuple, y: torch.Tensor) -> tuple:
        return (lambda i: F.cross_entropy(plain(*inputs).logits[i], y[i]),
                lambda: plain(*inputs, labels=y).loss)  # fmt: skip

    return losses


def _spans(model: torch.nn.Module, inputs: tuple) -> torch.Tensor:
    out = model(*inputs)
    return torch.stack([out.start_logits, out.end_logits], 1)  # (B, 2, T)


def _answer_losses(plain: torch.nn.Module):
    def losses(inputs: tuple, y: torch.Tensor) -> tuple:
        return (lambda i: F.cross_entropy(_spans(plain, inputs)[i], y[i]),  # the two's mean
                lambda: plain(*inputs, start_positions=y[:, 0], end_positions=y[:, 1]).loss)  # fmt: skip

    return losses


def test_a_multiple_choice_rows_norm_is_the_loops_under_the_batchs_masks(tmp_path):
    """Each example is its choices' rows (the model runs them as rows of their own): the
    analysis's first try, with the rows a batch shares expanded, fails for it, and its checks
    of the padded batch's branch must still run as the batch drew (before the fix, the step
    left the generators where it began, the next step drawing this one's masks)."""
    plain, rows = _model("MultipleChoice"), _rows("MultipleChoice")
    batches = []
    for part in (rows[:4], rows[4:]):  # one shape, other values
        b = _batch(part)
        batches.append((tuple(b[k] for k in KEYWORDS), b["labels"]))
    watched_as_looped(
        _model("MultipleChoice"), plain, tmp_path / "w.parquet", batches, _choice_losses(plain),
        loss="cross_entropy", keywords=KEYWORDS, output="logits",
    )  # fmt: skip


def test_a_question_answerers_row_is_its_start_and_end_mean(tmp_path):
    """Each row's loss is the mean of its start's and its end's cross entropy, the batch's
    transformers' own loss; each norm the loop's under the batch's masks."""
    plain, rows = _model("QuestionAnswering"), _rows("QuestionAnswering")
    batches = []
    for part in (rows[:4], rows[4:]):
        b = _batch(part)
        y = torch.stack([b["start_positions"], b["end_positions"]], 1)
        batches.append((tuple(b[k] for k in KEYWORDS), y))
    table = watched_as_looped(
        _model("QuestionAnswering"), plain, tmp_path / "w.parquet", batches,
        _answer_losses(plain), loss="cross_entropy", forward=_spans,
    )  # fmt: skip
    assert set(table["correct"]) <= {0.0, 0.5, 1.0}  # the share of start and end predicted


def _trainer(tmp_path, kind: str, callbacks: list, rows: list[dict] | None = None):
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, seed=0,
    )  # fmt: skip
    model, data = _model(kind), datasets.Dataset.from_list(rows or _rows(kind))
    trainer = transformers.Trainer(
        model, args, train_dataset=data, data_collator=_batch, callbacks=callbacks
    )
    return model, trainer


@pytest.mark.parametrize("kind", ["MultipleChoice", "QuestionAnswering"])
def test_a_trainer_of_choices_or_answers_trains_as_without_the_watch(tmp_path, kind):
    def train(callbacks: list) -> torch.nn.Module:
        model, trainer = _trainer(tmp_path, kind, callbacks)
        trainer.train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    assert np.isfinite(table["grad_norm"]).all() and np.isfinite(table["loss"]).all()


def test_an_answer_past_the_tokens_is_one_line(tmp_path):
    """transformers' loss leaves an end past the tokens out of the ends' mean: not each row's
    mean of two, so refused, the model as it was."""
    rows = _rows("QuestionAnswering")
    rows[2]["end_positions"] = TOKENS + 3
    model, trainer = _trainer(tmp_path, "QuestionAnswering", [WatchCallback(tmp_path / "w")], rows)
    with pytest.raises(ModelError, match="row of id 2 lies past its 6 tokens") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


def test_a_question_answerers_record_is_one_line(tmp_path):
    callback = WatchCallback(tmp_path / "w.parquet", record=tmp_path / "run")
    model, trainer = _trainer(tmp_path, "QuestionAnswering", [callback])
    with pytest.raises(ConfigError, match="record= of a question answerer"):
        trainer.train()
    assert "forward" not in model.__dict__


def test_a_question_answerer_given_labels_is_one_line_of_another_kind(tmp_path):
    """A label a row is a classifier's: a question answerer given one is not taken for one."""
    rows = [{k: v for k, v in r.items() if "positions" not in k} | {"labels": i % 2}
            for i, r in enumerate(_rows("QuestionAnswering"))]  # fmt: skip
    model, trainer = _trainer(tmp_path, "QuestionAnswering", [WatchCallback(tmp_path / "w")], rows)
    with pytest.raises(ConfigError, match="not a BertForQuestionAnswering with labels"):
        trainer.train()
    assert "forward" not in model.__dict__
