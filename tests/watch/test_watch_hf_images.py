"""The watch of an image classifier under the Hugging Face ``Trainer``: its loss is a sequence
classifier's (transformers takes them alike), its rows' norms the loop's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from oracle import trained_alike, watched_as_looped
from project import trainer_args

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _vit() -> torch.nn.Module:
    """A one-layer ViT of 8x8 images in 4x4 patches, three classes, its dropout on (0.1)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=16, num_labels=3, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config).double().train()


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.arange(8) % 3


def test_each_images_norm_is_the_loops_under_the_batchs_masks(tmp_path):
    plain = _vit()
    pixels, y = _images()

    def losses(inputs, y):
        return (lambda i: F.cross_entropy(plain(*inputs).logits[i], y[i]),
                lambda: F.cross_entropy(plain(*inputs).logits, y))  # fmt: skip

    batches = [((pixels[:4],), y[:4]), ((pixels[4:],), y[4:])]  # one shape, other values
    watched_as_looped(_vit(), plain, tmp_path / "w.parquet", batches, losses, output="logits")


def test_an_image_classifiers_trainer_trains_as_without_the_watch(tmp_path):
    """A ViT's Trainer (it was refused: an image classifier was no kind the callback knew)."""
    pixels, y = _images()
    data = datasets.Dataset.from_dict(
        {"pixel_values": pixels.tolist(), "labels": y.tolist(), "example_id": list(range(8))}
    ).with_format("torch")
    args = trainer_args(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, seed=0,
    )  # fmt: skip

    def train(callbacks: list) -> torch.nn.Module:
        model = _vit()
        transformers.Trainer(model, args, train_dataset=data, callbacks=callbacks).train()
        return model

    table = trained_alike(tmp_path, train)
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    assert np.isfinite(table["correct"]).all()
