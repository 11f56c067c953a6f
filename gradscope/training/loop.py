"""The recipe's training loop: a fresh model, the chosen rows in a seeded order, PyTorch's
optimizer and the schedule, bit-for-bit the same for the same config, rows and seed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..config import Config, TrainConfig
from ..errors import ConfigError, GradscopeError, ModelError, one_line
from ..io.batch import Batch, take
from ..io.data import open_dataset
from ..io.model import build_model
from ..job import Forward, config_forward, config_loss, resolve_device
from .recipe import lr_factor, make_optimizer, total_steps
from .user import run_user_fn


def recipe(cfg: Config) -> TrainConfig:
    """The config's ``train`` section; a config without one cannot be trained."""
    if cfg.train is None:
        raise ConfigError(
            "the config has no 'train' section: gradscope cannot retrain it", cfg.source
        )
    return cfg.train


class TrainingRows:
    """The rows to train on, read once and kept unpadded; a step's batch is padded as a run's."""

    def __init__(self, cfg: Config, rows: Sequence[int] | np.ndarray | None):
        self.dataset = open_dataset(cfg.data)
        n = len(self.dataset) if cfg.data.limit is None else min(len(self.dataset), cfg.data.limit)
        whole = next(self.dataset.batches(n, cfg.data.limit, pad=False))
        self.positions = np.arange(n) if rows is None else _positions(rows, n)
        self.rows: Batch = take(whole, torch.as_tensor(self.positions))
        self.device = resolve_device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype) if cfg.dtype else None

    def __len__(self) -> int:
        return len(self.positions)

    def batch(self, picked: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
        """The rows at ``picked`` (positions among the training rows), padded, on the device."""
        batch = self.dataset.columns.padded(take(self.rows, picked))
        return tuple(self.move(t) for t in batch.inputs), batch.targets.to(self.device)

    def move(self, t: Tensor) -> Tensor:
        """An input column on the device, floating point in the config's dtype."""
        floating = self.dtype if t.is_floating_point() else None
        return t.to(self.device, floating)


def _positions(rows: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    positions = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(positions) == 0:
        raise ConfigError("no rows to train on", "train")
    if positions.min() < 0 or positions.max() >= n or len(np.unique(positions)) != len(positions):
        raise ConfigError(f"the rows to train on must be distinct positions in 0..{n - 1}", "train")
    return np.sort(positions)


def build(cfg: Config, seed: int) -> nn.Module:
    """The model as training begins: the factory's initialisation under ``seed``, or
    ``train.init``'s weights; never ``model.checkpoint``, which is what training makes."""
    start = dataclasses.replace(cfg.model, checkpoint=recipe(cfg).init, checkpoints=[])
    torch.manual_seed(seed)
    model = build_model(start)
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    return model.to(device=resolve_device(cfg.device), dtype=dtype)


@dataclasses.dataclass
class Trainer:
    """One training run in progress: the model, its optimizer, and where it is in the recipe."""

    cfg: Config
    model: nn.Module
    rows: TrainingRows
    seed: int
    on_rows: Callable[[int], None] | None = None  # after each step, the rows it trained on
    weights: Tensor | None = None  # (len(rows),) each row's weight in its batch's loss; None: 1
    before_step: Callable[[Trainer, Tensor], None] | None = None  # as each step begins, its rows
    step: int = 0
    epoch: int = 0
    loss_sum: float = 0.0  # the training losses of the pass so far, summed over steps

    def __post_init__(self) -> None:
        self.train = recipe(self.cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ModelError("the model has no parameter that requires grad to train", "model")
        self.optimizer = make_optimizer(self.train, self.params)
        self.batch_size = self.train.batch_size or self.cfg.data.batch_size
        self.total = total_steps(self.train, len(self.rows), self.batch_size)
        self.last_loss = float("nan")  # the mean training loss of the last whole pass
        self.order = torch.Generator().manual_seed(self.seed)  # the rows' order, pass by pass
        self.forward = config_forward(self.cfg)
        self.loss = config_loss(self.cfg, alone=False)  # training needs no example's own

    def state(self) -> dict:
        """What a resumed run needs to go on exactly as this one would."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "order": self.order.get_state(),
            "rng": torch.get_rng_state(),
        }

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.order.set_state(state["order"])
        torch.set_rng_state(state["rng"])

    def epochs(self) -> Iterator[int]:
        """Train pass by pass; after each pass, its number (1-based). Ends at the last step."""
        n = len(self.rows)
        self.model.train()
        while self.step < self.total:
            self.loss_sum, steps = 0.0, self.step
            order = torch.randperm(n, generator=self.order) if self.train.shuffle else None
            order = torch.arange(n) if order is None else order
            for picked in order.split(self.batch_size):
                if self.step == self.total:
                    break
                self._step(picked)
            self.last_loss = self.loss_sum / max(1, self.step - steps)
            self.epoch += 1
            self._check_finite()
            yield self.epoch
        self.model.eval()

    def _check_finite(self) -> None:
        """A pass whose last step left a weight NaN or infinite has diverged: nothing to save."""
        if not all(torch.isfinite(p).all() for p in self.params):
            raise ModelError(
                f"training diverged: a weight is NaN or infinite after step {self.step}; lower "
                "train.lr or set train.clip",
                "train",
            )

    def run(self) -> None:
        """Every pass, to the last step."""
        for _ in self.epochs():
            pass

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based ``step`` (of the last one, past the end)."""
        return self.train.lr * lr_factor(self.train, min(step, self.total - 1), self.total)

    def _step(self, picked: Tensor) -> None:
        if self.before_step:
            self.before_step(self, picked)
        inputs, targets = self.rows.batch(picked)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        losses = self._losses(inputs, targets)
        # their mean, each times its row's weight when the run has weights (a weight of 0 keeps
        # the row's place in the order, not its pull)
        weights = None if self.weights is None else self.weights[picked]
        if weights is None:
            loss = losses.mean()
        else:
            loss = (losses * weights.to(losses.device, losses.dtype)).sum() / len(losses)
        if not torch.isfinite(loss):
            raise ModelError(self._diverged(loss, losses, picked), "train")
        loss.backward()
        if self.train.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.train.clip)
        try:
            self.optimizer.step()
        except RuntimeError as e:  # an lr the parameters' dtype cannot hold (1e300 in float32)
            raise ModelError(f"step {self.step + 1}'s update failed: {one_line(e)}", "train") from e
        self.step += 1
        self.loss_sum += loss.item()
        if self.on_rows:
            self.on_rows(len(picked))

    def _losses(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """(B,) the per-example losses; the model's errors one line."""
        output = forward_or_error(self.forward, self.model, inputs, "while training", "data.inputs")
        return self.loss(output, targets)

    def _diverged(self, loss: Tensor, losses: Tensor, picked: Tensor) -> str:
        """What a step whose loss is not finite says: the first row whose own loss is not."""
        said = (
            f"training diverged: the loss is {loss.item()} at step {self.step + 1} of {self.total}"
        )
        bad = torch.nonzero(~torch.isfinite(losses.detach())).flatten()
        if len(bad) == 0:
            return f"{said} (train.lr too high?)"
        row, value = int(self.rows.positions[int(picked[bad[0]])]), losses[bad[0]].item()
        return f"{said}, row {row}'s own being {value} (a NaN or infinite value in it?)"


def forward_or_error(
    forward: Forward, model: nn.Module, inputs: tuple[Tensor, ...], during: str, where: str
) -> Tensor:
    """``forward(model, inputs)``; whatever the model's own forward raises, one line naming
    ``during`` (``while training``, ``on REF``) and ``where``."""
    try:
        return forward(model, inputs)
    except GradscopeError:
        raise
    except Exception as e:
        raise ModelError(
            f"the model's forward raised {type(e).__name__} {during}: {one_line(e)}", where
        ) from e


def fit(
    cfg: Config,
    rows: Sequence[int] | np.ndarray | None = None,
    *,
    seed: int | None = None,
    weights: Sequence[float] | np.ndarray | Tensor | None = None,
) -> nn.Module:
    """Train a fresh model by ``cfg.train`` on the dataset rows ``rows`` (0-based positions in
    ``data.path``; None: every row up to ``data.limit``) and return it in eval mode.

    ``weights``, one per training row in their sorted order, multiply each row's loss in its
    batch's mean (the divisor stays the batch's row count): a weight of 0 removes the row's
    pull while every batch keeps the rows, order and randomness of the full run.

    The model is built by ``model.factory`` under ``torch.manual_seed(seed)`` (``train.seed``
    when None), or loaded from ``train.init``; ``model.checkpoint`` is not read. The same
    config, rows and seed give the same weights bit for bit on the CPU. The caller's random
    state is left as it was.
    """
    train = recipe(cfg)
    seed = train.seed if seed is None else seed
    with torch.random.fork_rng(devices=[]):
        training = TrainingRows(cfg, rows)
        model = build(cfg, seed)
        if train.fn is not None:
            if weights is not None:
                raise ConfigError(
                    "train.fn cannot weigh rows: it is given rows, not weights", "train.fn"
                )
            return run_user_fn(train.fn, model, training.positions, seed)
        Trainer(cfg, model, training, seed, weights=_weights(weights, len(training))).run()
    return model


def _weights(weights: Sequence[float] | np.ndarray | Tensor | None, n: int) -> Tensor | None:
    if weights is None:
        return None
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64)).reshape(-1)
    if len(w) != n or not torch.isfinite(w).all():
        raise ConfigError(f"the rows' weights must be {n} finite numbers, one per row", "train")
    return w
