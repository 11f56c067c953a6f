"""The watch of a speech classifier under the Hugging Face ``Trainer``, as fine-tuning runs it:
SpecAugment's masks over time, which transformers draws from numpy's generator, dropout and
LayerDrop. The run trains as without the watch (it was refused: the step's second forward drew
other masks from numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import trained_alike
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _wav2vec2() -> torch.nn.Module:
    """A two-layer wav2vec 2.0 classifier of 400 samples (23 frames), three classes, its time
    masks (spans of 2 over 0.3 of the frames), dropout 0.1 and LayerDrop 0.3 on."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, num_labels=3, mask_time_prob=0.3, mask_time_length=2,
        layerdrop=0.3, hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
        feat_proj_dropout=0.1, final_dropout=0.1,
    )  # fmt: skip
    return transformers.Wav2Vec2ForSequenceClassification(config).double().train()


def _collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    batch = {k: torch.tensor([r[k] for r in rows]) for k in ("labels", "example_id")}
    return batch | {"input_values": torch.tensor([r["input_values"] for r in rows]).double()}


def test_a_speech_classifiers_trainer_trains_as_without_the_watch(tmp_path):
    g = torch.Generator().manual_seed(1)
    sound = torch.randn(8, 400, generator=g, dtype=torch.float64)
    data = datasets.Dataset.from_dict(
        {
            "input_values": sound.tolist(),
            "labels": [i % 3 for i in range(8)],
            "example_id": list(range(8)),
        }  # fmt: skip
    )
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, optim="sgd", seed=0,
    )  # fmt: skip
    states = []

    def train(callbacks: list) -> torch.nn.Module:
        np.random.seed(0)
        model = _wav2vec2()
        transformers.Trainer(
            model, args, train_dataset=data, data_collator=_collate, callbacks=callbacks
        ).train()
        states.append(np.random.get_state()[1:3])
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    (keys, at), (kept, where) = states
    assert at == where and np.array_equal(keys, kept)  # numpy's generator left as it was
