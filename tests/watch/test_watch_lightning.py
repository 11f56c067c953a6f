"""The watch as a Lightning callback: the run trains as it would without it, and writes a
row per example and step."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from gradscope.training.watch_lightning import WatchCallback  # noqa: E402


class _Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y, _ = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none").mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def _fit(callbacks, accumulate):
    torch.manual_seed(1)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    data = torch.utils.data.TensorDataset(x, y, torch.arange(8))
    module = _Module()
    trainer = pl.Trainer(
        max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=0.5,
        callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_trains_as_without_the_watch_and_writes_each_step(tmp_path, accumulate):
    plain = _fit([], accumulate)
    watched = _fit([WatchCallback(tmp_path / "w.parquet")], accumulate)
    for p, q in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)  # batches of 4: the mean's gradient bit for bit
    assert "training_step" not in watched.__dict__
    table = pq.read_table(tmp_path / "w.parquet").to_pydict()
    assert table["example_id"] == list(range(8)) * 2
    assert table["epoch"] == [0] * 8 + [1] * 8
