"""A benchmark setting as the peers see it, read from its gradscope config with plain torch.

The peers live in their own environment (PEERS.md), without gradscope: this module reads what
they need from the config (the model factory, the data, the loss) and nothing else. It knows
the shapes this benchmark's configs use: ``file.py:Name``, ``module:Name`` or a Hugging Face
causal LM with ``pretrained``; data in a ``.pt`` dict (x, y) or a Parquet file of token rows;
the losses cross_entropy, mse and causal_lm.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}


@dataclass
class Setting:
    config: Path
    factory: str
    kwargs: dict
    pretrained: Path | None
    loss: str  # cross_entropy | mse | causal_lm
    data: Path

    @classmethod
    def read(cls, config: str | Path) -> Setting:
        config = Path(config).resolve()
        raw = yaml.safe_load(config.read_text())
        model = raw["model"]
        pretrained = model.get("pretrained")
        return cls(
            config=config,
            factory=model["factory"],
            kwargs=model.get("kwargs") or {},
            pretrained=(config.parent / pretrained).resolve() if pretrained else None,
            loss=raw["loss"]["name"],
            data=(config.parent / raw["data"]["path"]).resolve(),
        )

    @property
    def lm(self) -> bool:
        return self.loss == "causal_lm"

    def model(self, checkpoint: str | Path) -> nn.Module:
        """The factory's model with the state dict at ``checkpoint``, in eval mode."""
        where, name = self.factory.rsplit(":", 1)
        if where == "transformers":
            made = getattr(importlib.import_module(where), name).from_pretrained(self.pretrained)
        else:
            made = getattr(_module(where, self.config.parent), name)(**self.kwargs)
        made.load_state_dict(torch.load(checkpoint, weights_only=True))
        return made.eval()

    def rows(self, path: str | Path | None = None) -> list:
        """The rows of ``path`` (the training data by default): (x, y) pairs or token dicts."""
        path = Path(path or self.data)
        if path.suffix == ".parquet":
            table = pq.read_table(path, columns=list(PAD))
            return table.to_pylist()
        data = torch.load(path, weights_only=True)
        return list(zip(data["x"], data["y"], strict=True))

    def collate(self, rows: list):
        """A batch: (x (B, ...), y (B, ...)), or padded token tensors (B, T)."""
        if not self.lm:
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        longest = max(len(r["input_ids"]) for r in rows)
        return {k: torch.tensor([r[k] + [v] * (longest - len(r[k])) for r in rows]) for k, v in PAD.items()}  # fmt: skip

    def per_example_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """(B,) each row's loss, as the config's loss computes it."""
        if self.loss == "cross_entropy":
            return F.cross_entropy(outputs, targets, reduction="none")
        if self.loss == "mse":
            return (outputs - targets).pow(2).flatten(1).mean(1)
        logits, labels = outputs[:, :-1], targets[:, 1:]  # next token, mean over a row's tokens
        flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return flat.view(labels.shape).sum(1) / (labels != -100).sum(1).clamp_min(1)

    def forward(self, model: nn.Module, batch) -> tuple[Tensor, Tensor]:
        """(outputs, targets) of a collated batch."""
        if not self.lm:
            return model(batch[0]), batch[1]
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits, batch["labels"]


def _module(where: str, base: Path):
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = (base / where).resolve()
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
