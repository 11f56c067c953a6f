"""The recipe's optimizer and learning-rate schedule, as PyTorch and Hugging Face define them."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError


def make_optimizer(train: TrainConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """PyTorch's own SGD, Adam or AdamW with the recipe's settings (weight decay: an L2 term
    added to the gradient for ``sgd`` and ``adam``, decoupled for ``adamw``)."""
    params = list(params)
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            params,
            lr=train.lr,
            momentum=train.momentum,
            nesterov=train.nesterov,
            weight_decay=train.weight_decay,
        )
    kind = torch.optim.Adam if train.optimizer == "adam" else torch.optim.AdamW
    betas = (train.betas[0], train.betas[1])
    return kind(params, lr=train.lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay)


def lr_factor(train: TrainConfig, step: int, total: int) -> float:
    """The learning rate of 0-based ``step`` of ``total``, as a fraction of ``train.lr``: Hugging
    Face's ``get_{constant,linear,cosine}_schedule_with_warmup`` (step 0 of a warm-up is 0)."""
    warmup = train.warmup
    if step < warmup:
        return step / max(1, warmup)
    if train.schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if train.schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def total_steps(train: TrainConfig, rows: int, batch_size: int) -> int:
    """Optimizer steps in the run: ``train.steps``, or every batch of ``train.epochs`` passes."""
    if train.steps is not None:
        return train.steps
    return (train.epochs or 1) * -(-rows // batch_size)


def check_warmup(train: TrainConfig, rows: int, batch_size: int) -> None:
    """``gradscope train``'s run must outlast its warm-up: its learning rate never reached
    ``train.lr`` otherwise, without a word (validate's shorter runs on subsets keep it)."""
    total = total_steps(train, rows, batch_size)
    if train.warmup > total:
        raise ConfigError(
            f"train.warmup is {train.warmup} steps and the run takes {total}: its learning rate "
            "would never reach train.lr",
            "train.warmup",
        )


def total_rows(train: TrainConfig, rows: int, batch_size: int) -> int:
    """Rows the run's steps train on, counted once per step that sees them (for progress)."""
    per_pass = -(-rows // batch_size)
    steps = total_steps(train, rows, batch_size)
    return (steps // per_pass) * rows + (steps % per_pass) * batch_size
