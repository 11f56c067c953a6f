"""The config file's ``train`` section: how the model was trained, each key checked by itself
(the keys that must agree with each other in validate.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError
from .typed import at_least

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """``train``: how the model was trained, so that gradscope can train it again
    (``gradscope train``, and the retrains ``gradscope validate`` measures scores against)."""

    optimizer: str = "sgd"
    """``sgd``, ``adam`` or ``adamw``, with PyTorch's update rules."""
    lr: float = 0.1
    """The peak learning rate."""
    momentum: float = 0.0
    """``sgd`` only: the momentum factor."""
    nesterov: bool = False
    """``sgd`` only: Nesterov momentum."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """``adam``/``adamw`` only: the decay rates of the first and second moments."""
    eps: float = 1e-8
    """``adam``/``adamw`` only: added to the second moment's square root."""
    weight_decay: float = 0.0
    """``sgd``/``adam``: an L2 term added to the gradient; ``adamw``: decoupled decay."""
    schedule: str = "constant"
    """``constant``, ``linear`` (to 0 at the last step) or ``cosine`` (to 0 at the last step),
    after the warm-up."""
    warmup: int = 0
    """Steps of linear warm-up from 0 to ``lr``."""
    epochs: int | None = None
    """Passes over the training rows; unset with ``steps`` unset: 1."""
    steps: int | None = None
    """Optimizer steps instead of ``epochs``; the rows are passed over as often as that takes."""
    batch_size: int | None = None
    """Rows per optimizer step; unset: ``data.batch_size``. The last batch of a pass may be
    smaller."""
    seed: int = 0
    """Seeds the initialisation, the order of the rows and any dropout the model draws."""
    shuffle: bool = True
    """A new order of the rows for each pass, drawn from ``seed``; false: the data's order."""
    clip: float | None = None
    """Clip the gradient's global L2 norm to this before each step."""
    init: str | None = None
    """A state dict to start from (fine-tuning), as ``model.checkpoint`` takes; unset: the
    factory's own initialisation under ``seed`` (a Hugging Face ``model.pretrained`` folder's
    weights, when it names one). ``model.checkpoint`` is never read: it is what training makes."""
    save_every: int | None = None
    """Also write a checkpoint every K epochs beside the final one (``model.epochK.pt``), for
    ``influence`` over ``model.checkpoints`` (an ensemble; TracIn with ``--curvature none``)."""
    fn: str | None = None
    """``file.py:train``: your own loop instead of the recipe, for loops gradscope does not know
    (a Hugging Face ``Trainer``, Lightning). Called as ``fn(model, rows, seed)`` with the freshly
    built model, the 0-based positions in ``data.path`` of the rows to train on (a sorted int64
    array) and the seed; it trains the model in place (returning None) or returns the trained
    model. The recipe's other keys but ``seed`` and ``init`` are then refused: it reads none."""

    def check(self, source: str) -> None:
        """A recipe PyTorch's optimizers take, and a run of at least one step."""
        for key, value, allowed in (
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("schedule", self.schedule, SCHEDULES),
        ):
            if value not in allowed:
                raise ConfigError(
                    f"'train.{key}' must be one of {', '.join(allowed)}, got {value!r}", source
                )
        for key in ("lr", "momentum", "eps", "weight_decay"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"'train.{key}' must be a finite number >= 0, got {value}", source
                )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"'train.betas' must be two numbers in [0, 1), got {self.betas}", source
            )
        if self.clip is not None and not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"'train.clip' must be a positive number, got {self.clip}", source)
        keys = ("epochs", "steps", "batch_size", "save_every")
        at_least(1, {f"train.{key}": getattr(self, key) for key in keys}, source)
        # numpy's generators, which draw validate's subsets, take no negative seed
        at_least(0, {"train.seed": self.seed, "train.warmup": self.warmup}, source)
        if self.fn is not None and ":" not in self.fn:
            raise ConfigError(f"'train.fn' must be file.py:function, got {self.fn!r}", source)
