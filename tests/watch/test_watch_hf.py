"""The watch as a Hugging Face Trainer callback: the run it serves trains as it would
without it, and writes a row per example and step."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from oracle import trained_alike, watched_as_looped
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradscope.errors import ConfigError, ModelError  # noqa: E402
from gradscope.training.watch import Watch  # noqa: E402
from gradscope.training.watch_hf import WatchCallback  # noqa: E402


def _run(tmp_path, callbacks, accumulate=1):
    model, trainer = _trainer(tmp_path, callbacks, accumulate)
    trainer.train()
    return model, trainer


def _trainer(tmp_path, callbacks, accumulate=1, **more):
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
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4 // accumulate,
        gradient_accumulation_steps=accumulate, num_train_epochs=2, learning_rate=1e-2, seed=0,
        data_seed=0, eval_strategy="epoch", **more,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model, args, train_dataset=data, eval_dataset=data.select(range(4)), callbacks=callbacks
    )
    return model, trainer


def _hooks(model) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            + len(m._backward_pre_hooks) for m in model.modules()]  # fmt: skip


def test_a_step_that_raises_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    callback = WatchCallback(tmp_path / "w.parquet")
    model, trainer = _trainer(tmp_path, [callback])
    hooks, step, calls = _hooks(model), Watch.step, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Watch, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert "forward" not in model.__dict__ and _hooks(model) == hooks
    assert callback.watch is None


class _Raises(transformers.TrainerCallback):
    def on_step_end(self, *args, **kwargs):
        raise RuntimeError("after the model's call")


@pytest.mark.parametrize(
    "setting",
    [
        {"fp16": True},
        {"label_smoothing_factor": 0.1},
        {"torch_compile": True},
        {"neftune_noise_alpha": 5.0},
    ],  # fmt: skip
)
def test_a_setting_the_watch_cannot_serve_is_one_line_before_it_trains(tmp_path, setting):
    """fp16's loss scaler, label smoothing, a compiled model (which failed inside dynamo as
    the watch set it aside), NEFTune's noise (refused as dropout's would be, where examples run
    alone): refused as training begins, the model as it was."""
    callback = WatchCallback(tmp_path / "w.parquet")
    model, trainer = _trainer(tmp_path, [callback], **setting)
    with pytest.raises(ConfigError, match=f"TrainingArguments.{next(iter(setting))}") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__
    assert not (tmp_path / "w.parquet").exists()


def test_a_train_that_raised_elsewhere_is_released_by_the_next(tmp_path):
    callback = WatchCallback(tmp_path / "w.parquet")
    model, trainer = _trainer(tmp_path, [callback, _Raises])
    with pytest.raises(RuntimeError, match="after the model's call"):
        trainer.train()
    trainer.remove_callback(_Raises)
    trainer.train()  # wraps the model once, not the wrapper again
    assert "forward" not in model.__dict__ and callback.watch is None
    assert len(pq.read_table(tmp_path / "w.parquet")) == 16


def test_a_new_callback_releases_the_wrapper_another_left(tmp_path):
    """A train() that raised outside the model's call left the first callback's wrapper: a new
    WatchCallback wrapped it again, and its first step was refused as a call without labels."""
    model, trainer = _trainer(tmp_path, [WatchCallback(tmp_path / "a.parquet"), _Raises])
    with pytest.raises(RuntimeError, match="after the model's call"):
        trainer.train()
    args = trainer_args(str(tmp_path / "out2"), per_device_train_batch_size=4, num_train_epochs=1)
    again = transformers.Trainer(model, args, train_dataset=trainer.train_dataset,
                                 callbacks=[WatchCallback(tmp_path / "b.parquet")])  # fmt: skip
    again.train()
    assert "forward" not in model.__dict__
    assert len(pq.read_table(tmp_path / "b.parquet")) == 8


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


# eager attention: sdpa's has no double backward on the CPU
GPT2 = {"vocab_size": 16, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "attn_implementation": "eager"}  # fmt: skip


# eager attention: sdpa's has no double backward on the CPU
BERT = {"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16, "max_position_embeddings": 8, "num_labels": 3,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "attn_implementation": "eager"}  # fmt: skip
KINDS = {  # a causal language model, its labels its tokens; a classifier, a class a row; a
    # token classifier, a class a token
    "lm": ("GPT2LMHeadModel", GPT2, "causal_lm", lambda tokens: tokens),
    "classifier": ("BertForSequenceClassification", BERT, "cross_entropy", lambda t: t[:, 0] % 3),
    "tagger": ("BertForTokenClassification", BERT, "cross_entropy", lambda t: t % 3),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_trainer_records_the_run_gradscope_train_records(tmp_path, kind):
    """The run record written through the callback (the Trainer's AdamW, linear schedule and
    clip read off it; rows of one length, so a language model's or a tagger's token mean is
    the mean of the rows' own) replays as ``gradscope train --record``'s of the same recipe,
    start and order."""
    import yaml

    from gradscope.config import load_config
    from gradscope.training.replay import through_training
    from gradscope.training.run import train_model

    name, model_config, loss, labelled = KINDS[kind]
    config_class = transformers.GPT2Config if kind == "lm" else transformers.BertConfig
    torch.manual_seed(0)
    model = getattr(transformers, name)(config_class(**model_config)).double()
    torch.save(model.state_dict(), tmp_path / "init.pt")
    tokens = torch.randint(1, 16, (8, 6))
    torch.save({"ids": tokens, "labels": labelled(tokens)}, tmp_path / "data.pt")
    ref = torch.randint(1, 16, (2, 6))
    torch.save({"ids": ref, "labels": labelled(ref)}, tmp_path / "ref.pt")
    train = {
        "optimizer": "adamw",
        "lr": 1e-2,
        "weight_decay": 0.0,
        "schedule": "linear",
        "epochs": 2,
        "batch_size": 4,
        "shuffle": False,
        "clip": 0.1,
        "init": "init.pt",
    }
    config = {
        "model": {"factory": f"transformers:{name}", "config": model_config},
        "data": {"path": "data.pt", "inputs": "ids", "targets": "labels", "batch_size": 4},
        "loss": {"name": loss},
        "dtype": "float64",
        "device": "cpu",
        "train": train,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "config.yaml")
    want = through_training(cfg, train_model(cfg, tmp_path / "out.pt", record=True).record,
                            tmp_path / "ref.pt", per_ref=True)  # fmt: skip
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens.tolist(), "labels": labelled(tokens).tolist(),
         "example_id": list(range(8))}
    )  # fmt: skip
    args = trainer_args(
        str(tmp_path / "hf"), per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-2,
        max_grad_norm=0.1, train_sampling_strategy="sequential",
    )  # fmt: skip
    callback = WatchCallback(tmp_path / "w.parquet", record=tmp_path / "hf.run", segment=2)
    if kind == "lm":  # else the Trainer divides by every label, the first too
        model.loss_type = "ForCausalLM"
    transformers.Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
    got = through_training(cfg, tmp_path / "hf.run", tmp_path / "ref.pt", per_ref=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10 * np.abs(want).max())


def test_a_trainer_with_dropout_records_a_run_the_replay_retraces(tmp_path):
    """GPT-2's dropout on: the record holds the random state each segment began in and that of
    each epoch's first step (the Trainer's loader draws a seed as an epoch begins), and every
    segment recomputed from its checkpoint reaches the weights the run reached, which no mask
    drawn otherwise would."""
    import yaml

    from gradscope.config import load_config
    from gradscope.training.record import open_record
    from gradscope.training.replay import through_training

    dropout = GPT2 | {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**dropout)).double()
    model.loss_type = "ForCausalLM"
    tokens = torch.randint(0, 16, (8, 6))
    torch.save({"ids": tokens}, tmp_path / "data.pt")
    torch.save({"ids": torch.randint(0, 16, (2, 6))}, tmp_path / "ref.pt")
    config = {
        "model": {"factory": "transformers:GPT2LMHeadModel", "config": dropout},
        "data": {"path": "data.pt", "inputs": "ids", "targets": "ids", "batch_size": 4},
        "loss": {"name": "causal_lm"},
        "dtype": "float64",
        "device": "cpu",
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens.tolist(), "labels": tokens.tolist(), "example_id": list(range(8))}
    )
    args = trainer_args(
        str(tmp_path / "hf"), per_device_train_batch_size=4, num_train_epochs=3, learning_rate=1e-2,
    )  # fmt: skip
    callback = WatchCallback(tmp_path / "w.parquet", record=tmp_path / "hf.run", segment=3)
    transformers.Trainer(model, args, train_dataset=data, callbacks=[callback]).train()
    cfg = load_config(tmp_path / "config.yaml")
    assert sorted(open_record(tmp_path / "hf.run", cfg).drawn()) == [2, 4]
    scores = through_training(cfg, tmp_path / "hf.run", tmp_path / "ref.pt")
    assert scores.shape == (8,) and np.isfinite(scores).all() and np.abs(scores).max() > 0


def _bert(classes: int = 2) -> transformers.BertForSequenceClassification:
    """A BERT classifier with its dropout on (0.1, in its layers and in its attention)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=8, num_labels=classes,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).double().train()


def _padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads a batch to its longest row, as ``DataCollatorWithPadding`` does: that row has
    nothing padded, so alone it skips the attention mask the others need."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    labels = torch.tensor([r["labels"] for r in rows])
    example_ids = torch.tensor([r["example_id"] for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "example_id": example_ids}


def test_dropout_on_dynamically_padded_batches_is_watched_as_each_example_alone(tmp_path):
    """Each batch's longest row takes transformers' mask shortcut alone, which a step with
    dropout on checks with it left out: every norm is its loss's under the batch's masks, on
    the analysed batch and the replayed one."""
    plain, batches = _bert(), []
    for lengths in ([6, 3, 6, 4], [5, 6, 2, 6]):  # one shape, other values
        batch = _padded([{"input_ids": list(range(1, n + 1)), "labels": n % 2, "example_id": i}
                         for i, n in enumerate(lengths)])  # fmt: skip
        batches.append(((batch["input_ids"], batch["attention_mask"]), batch["labels"]))

    def losses(inputs, y):
        return (lambda i: torch.nn.functional.cross_entropy(plain(*inputs).logits[i], y[i]),
                lambda: torch.nn.functional.cross_entropy(plain(*inputs).logits, y))  # fmt: skip

    watched_as_looped(_bert(), plain, tmp_path / "w.parquet", batches, losses,
                      keywords=("input_ids", "attention_mask"), output="logits")  # fmt: skip


# a sequence classifier's kinds, as transformers' own loss tells them by their labels: the
# number of labels, and each row's label of its length n
PROBLEMS = {
    "single": (2, lambda n: n % 2),
    "regression": (1, lambda n: n / 6),
    "multi": (3, lambda n: [float(n % 2), float(n // 2 % 2), float(n > 4)]),
}


def _classifier_trainer(tmp_path, callbacks, accumulate=1, problem="single"):
    """A BERT classifier's Trainer on rows of 2 to 6 tokens padded to each batch's longest;
    single-label, a row's label -100 (not counted)."""
    classes, label = PROBLEMS[problem]
    rows = [{"input_ids": list(range(1, n + 1)), "labels": label(n), "example_id": i}
            for i, n in enumerate([6, 3, 5, 4, 2, 6, 3, 5])]  # fmt: skip
    if problem == "single":
        rows[2]["labels"] = -100
    model = _bert(classes)
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4 // accumulate, num_train_epochs=2,
        gradient_accumulation_steps=accumulate, learning_rate=1e-2, seed=0,
    )  # fmt: skip
    data = datasets.Dataset.from_list(rows)
    trainer = transformers.Trainer(
        model, args, train_dataset=data, data_collator=_padded, callbacks=callbacks
    )
    return model, trainer


@pytest.mark.parametrize(
    "problem, accumulate", [*((p, 1) for p in sorted(PROBLEMS)), ("multi", 2), ("regression", 2)]
)
def test_a_trainer_with_dropout_on_dynamically_padded_batches_trains_as_without(
    tmp_path, problem, accumulate
):
    """The Trainer's fine-tuning of a BERT classifier as most are run: dropout on, batches
    padded to their longest row; single-label, a row not counted (label -100) left out of the
    mean, as the model's own loss leaves it; a regression and a multi-label one too, also
    accumulated (their losses, transformers' MSE and BCE, each micro-batch's mean)."""

    def train(callbacks: list) -> torch.nn.Module:
        model, trainer = _classifier_trainer(tmp_path, callbacks, accumulate, problem)
        trainer.train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    assert np.isfinite(table["grad_norm"]).all()


def _reordered(rows: list[dict]) -> dict[str, torch.Tensor]:
    """``_padded``'s batch, its keys in the reverse order every other call."""
    _reordered.calls = getattr(_reordered, "calls", 0) + 1
    batch = _padded(rows)
    return dict(reversed(batch.items())) if _reordered.calls % 2 else batch


def test_a_batch_of_the_same_inputs_in_another_order_is_called_by_name(tmp_path):
    """A collator whose keys come in another order (attention_mask before input_ids) is called
    with each input by its name: the first step's order, as the model would take them (they
    were passed by position in the batch's order, swapped on every other step)."""

    def train(callbacks: list) -> torch.nn.Module:
        model, trainer = _classifier_trainer(tmp_path, callbacks)
        trainer.data_collator = _reordered
        trainer.train()
        return model

    trained_alike(tmp_path, train)


def test_a_batch_of_other_inputs_than_the_first_steps_is_one_line(tmp_path):
    def thinned(rows):  # the second batch without its attention mask
        thinned.calls = getattr(thinned, "calls", 0) + 1
        batch = _padded(rows)
        return {k: v for k, v in batch.items() if k != "attention_mask" or thinned.calls < 2}

    model, trainer = _classifier_trainer(tmp_path, [WatchCallback(tmp_path / "w.parquet")])
    trainer.data_collator = thinned
    with pytest.raises(ModelError, match="the first step's") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


def test_a_classifier_under_accumulation_is_one_line(tmp_path):
    """Accumulated, a classifier's loss is its micro-batch's mean (BERT's) or the step's sum
    over its counted rows (a model that takes num_items_in_batch): which, its class says."""
    model, trainer = _classifier_trainer(tmp_path, [WatchCallback(tmp_path / "w.parquet")], 2)
    with pytest.raises(ConfigError, match="gradient accumulation") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


def test_a_batch_without_labels_or_both_positions_is_one_line(tmp_path):
    """A question answerer's batch with start positions and no end ones, no labels: refused
    at the first step, naming the batch's keys."""
    model = transformers.BertForQuestionAnswering(_bert(2).config).double()
    rows = [{"input_ids": [1, 2, 3, 4], "start_positions": 1, "example_id": i}
            for i in range(4)]  # fmt: skip
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1)
    callback = WatchCallback(tmp_path / "w.parquet")
    trainer = transformers.Trainer(
        model, args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[callback]
    )
    with pytest.raises(ModelError, match="example_id, input_ids, start_positions") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


def test_a_model_of_another_kind_is_one_line_before_it_trains(tmp_path):
    """A next-sentence predictor's labels look like a sequence classifier's (a class a row),
    which it is not: refused at the first step, the model's own forward given back."""
    model = transformers.BertForNextSentencePrediction(_bert(2).config).double()
    rows = [{"input_ids": [1, 2, 3, 4], "labels": i % 2, "example_id": i} for i in range(4)]
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1)
    data = datasets.Dataset.from_list(rows)
    callback = WatchCallback(tmp_path / "w.parquet")
    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[callback])
    with pytest.raises(ConfigError, match="not a BertForNextSentencePrediction") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__
    assert not (tmp_path / "w.parquet").exists()


def test_a_causal_lm_whose_own_loss_is_unshifted_is_one_line(tmp_path):
    """BART's causal LM takes its labels as the next tokens already (no shift), as transformers'
    other causal LMs do not: the watch's loss of the first batch is not the model's own, so it
    is refused, not trained on another loss (before, the run ended 4e-3 from the plain one)."""
    torch.manual_seed(0)
    config = transformers.BartConfig(
        vocab_size=16, d_model=8, decoder_layers=1, decoder_attention_heads=2,
        decoder_ffn_dim=16, max_position_embeddings=8,
    )  # fmt: skip
    model = transformers.BartForCausalLM(config).double()
    tokens = torch.randint(3, 16, (4, 6)).tolist()
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "example_id": list(range(4))}
    )
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1)
    callback = WatchCallback(tmp_path / "w.parquet")
    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[callback])
    with pytest.raises(ConfigError, match="BartForCausalLM's own .*another loss") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and "forward" not in model.__dict__


class SummedBertForSequenceClassification(transformers.BertForSequenceClassification):
    """A classifier whose loss is its rows' sum: not the mean its kind takes."""

    def forward(self, labels=None, **kwargs):
        out = super().forward(**kwargs)
        if labels is not None:
            out.loss = F.cross_entropy(out.logits, labels, reduction="sum")
        return out


def _one_batch(tmp_path, model: torch.nn.Module) -> transformers.Trainer:
    """A watched Trainer of ``model`` on one padded batch of four rows of a label each."""
    rows = [{"input_ids": list(range(1, n + 1)), "labels": n % 2, "example_id": i}
            for i, n in enumerate([6, 3, 5, 4])]  # fmt: skip
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1)
    return transformers.Trainer(
        model, args, train_dataset=datasets.Dataset.from_list(rows), data_collator=_padded,
        callbacks=[WatchCallback(tmp_path / "w.parquet")],
    )  # fmt: skip


def test_a_classifier_with_a_loss_of_its_own_is_one_line(tmp_path):
    model = SummedBertForSequenceClassification(_bert(2).config).double().train()
    with pytest.raises(ConfigError, match="SummedBertForSequenceClassification's own") as e:
        _one_batch(tmp_path, model).train()
    assert "\n" not in str(e.value) and "forward" not in model.__dict__
    assert not (tmp_path / "w.parquet").exists()  # no rows of a loss it did not train on


class WeightedTrainer(transformers.Trainer):
    """A class-weighted loss of its own, from the model's logits: a common subclass."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = F.cross_entropy(out.logits, inputs["labels"], weight=out.logits.new_ones(2))
        return (loss, out) if return_outputs else loss


def test_a_trainer_whose_compute_loss_reads_the_logits_is_one_line(tmp_path):
    """The watched output held the loss alone and logits None: an AttributeError in the
    user's compute_loss ('NoneType' object has no attribute ...)."""
    model = _bert(2).double().train()
    trainer = _one_batch(tmp_path, model)
    trainer.__class__ = WeightedTrainer
    with pytest.raises(ModelError, match="holds the loss alone, not the model's logits") as e:
        trainer.train()
    assert "\n" not in str(e.value) and "forward" not in model.__dict__


class NanBertForSequenceClassification(transformers.BertForSequenceClassification):
    """A classifier whose output is not finite."""

    def forward(self, **kwargs):
        out = super().forward(**kwargs)
        out.logits = out.logits * float("nan")
        return out


def test_a_first_loss_that_is_not_finite_is_one_line(tmp_path):
    model = NanBertForSequenceClassification(_bert(2).config).double().train()
    with pytest.raises(ModelError, match="loss is nan as the watch takes it .* not finite"):
        _one_batch(tmp_path, model).train()
    assert "forward" not in model.__dict__


class LaterGPT2LMHeadModel(transformers.GPT2LMHeadModel):
    """A causal LM whose own loss gains a penalty on its weights once ``penalised``."""

    penalised = False

    def forward(self, **kwargs):
        out = super().forward(**kwargs)
        if self.penalised and out.loss is not None:
            out.loss = out.loss + 1e-2 * sum(p.square().sum() for p in self.parameters())
        return out


class _PenaliseAfterFirst(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **_):
        model.penalised = True


def test_a_loss_that_changes_after_the_first_step_is_refused_where_checked(tmp_path):
    """Checked again on the 2nd step (each epoch's first, the 2nd, 4th, 8th...; before, the
    first alone): refused there in one line, the watch file holding the first step's rows."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    model = LaterGPT2LMHeadModel(config).double()
    tokens = torch.randint(0, 16, (8, 6)).tolist()
    data = datasets.Dataset.from_dict(
        {"input_ids": tokens, "labels": tokens, "example_id": list(range(8))}
    )
    args = trainer_args(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1)
    trainer = transformers.Trainer(
        model, args, train_dataset=data,
        callbacks=[WatchCallback(tmp_path / "w.parquet"), _PenaliseAfterFirst()],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="on step 1's batch, LaterGPT2LMHeadModel's own") as e:
        trainer.train()
    assert "\n" not in str(e.value) and "forward" not in model.__dict__
    assert pq.read_table(tmp_path / "w.parquet").to_pydict()["step"] == [0] * 4


def test_the_logits_stand_in_refuses_every_use_and_releases_once_each():
    """torch.cat([it, t]) raised StopIteration: it was looked for among the top arguments."""
    from gradscope.training.watchkinds import NotKept

    released = []
    stand_in = NotKept("logits", released.append)
    uses = [lambda: torch.cat([stand_in, torch.ones(1)]), lambda: stand_in.dtype,
            lambda: F.cross_entropy(input=stand_in, target=torch.tensor([0])),
            lambda: stand_in[:, -1]]  # fmt: skip
    for use in uses:
        with pytest.raises(ModelError, match="holds the loss alone, not the model's logits"):
            use()
    assert len(released) == len(uses)
