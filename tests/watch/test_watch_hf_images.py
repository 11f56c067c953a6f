"""The watch of an image classifier under the Hugging Face ``Trainer``: its loss is a sequence
classifier's (transformers takes them alike), its rows' norms the loop's."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from oracle import redrawn_norms

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from gradscope.training.watch import Watch  # noqa: E402
from gradscope.training.watch_hf import WatchCallback  # noqa: E402


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
    model, plain = _vit(), _vit()
    pixels, y = _images()
    torch.manual_seed(3)
    with Watch(model, tmp_path / "w.parquet", output="logits") as watch:
        for _ in range(2):
            watch.step(pixels[:4], y[:4], torch.arange(4)).backward()
        assert not watch.engine.plan.fallback
    norms = redrawn_norms(
        plain, 4, 2, lambda i: F.cross_entropy(plain(pixels[:4]).logits[i], y[i]),
        lambda: F.cross_entropy(plain(pixels[:4]).logits, y[:4]),
    )  # fmt: skip
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    np.testing.assert_allclose(table["grad_norm"], norms, rtol=1e-8)


def test_an_image_classifiers_trainer_trains_as_without_the_watch(tmp_path):
    """A ViT's Trainer (it was refused: an image classifier was no kind the callback knew)."""
    pixels, y = _images()
    data = datasets.Dataset.from_dict(
        {"pixel_values": pixels.tolist(), "labels": y.tolist(), "example_id": list(range(8))}
    ).with_format("torch")
    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=1e-2, remove_unused_columns=False, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    trained = []
    for callbacks in ([], [WatchCallback(tmp_path / "w.parquet")]):
        model = _vit()
        transformers.Trainer(model, args, train_dataset=data, callbacks=callbacks).train()
        trained.append(model)
    for p, q in zip(*(m.parameters() for m in trained), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert sorted(table["example_id"]) == sorted(list(range(8)) * 2)
    assert np.isfinite(table["correct"]).all()
