"""The checks a config's values must pass together, after its types: every bad value is named
by its key path."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import ConfigError
from ..io.held import is_held  # a loss the API's caller passed
from .schema import DEVICES, DTYPES, OPTIMIZERS, SCHEDULES, Config, TrainConfig


def validate(cfg: Config) -> None:
    from ..losses import NAMES as LOSS_NAMES  # imports torch: not for --help, --version, summary

    source = cfg.source
    if not re.fullmatch(r"auto|(cpu|cuda|mps)(:\d+)?", cfg.device):
        raise ConfigError(
            f"'device' must be one of {', '.join(DEVICES)} or cuda:N, got {cfg.device!r}", source
        )
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(f"'dtype' must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}", source)
    if (
        ".py:" not in cfg.loss.name
        and cfg.loss.name not in LOSS_NAMES
        and not is_held(cfg.loss.name)
    ):
        names = ", ".join(LOSS_NAMES)
        raise ConfigError(
            f"'loss.name' must be one of {names} or file.py:fn, got {cfg.loss.name!r}", source
        )
    if cfg.output.metadata not in ("full", "minimal"):
        raise ConfigError(
            f"'output.metadata' must be full or minimal, got {cfg.output.metadata!r}", source
        )
    if cfg.loss.token_reduction not in ("mean", "sum"):
        raise ConfigError(
            f"'loss.token_reduction' must be mean or sum, got {cfg.loss.token_reduction!r}", source
        )
    for key, value in (
        ("data.batch_size", cfg.data.batch_size),
        ("summary.top_k", cfg.summary.top_k),
    ):
        if value < 1:
            raise ConfigError(f"'{key}' must be at least 1, got {value}", source)
    if cfg.data.limit is not None and cfg.data.limit < 1:
        raise ConfigError(f"'data.limit' must be at least 1, got {cfg.data.limit}", source)
    if cfg.data.path == []:
        raise ConfigError("'data.path' must name at least one file", source)
    _validate_checkpoints(cfg)
    weights = [c.weight for c in cfg.model.checkpoints]
    if any(not math.isfinite(w) or w < 0 for w in weights) or (weights and not any(weights)):
        # cosine over checkpoints is a cosine in the sqrt(weight)-scaled space: weights must be >= 0
        raise ConfigError(
            f"'model.checkpoints' weights must be finite, >= 0 and not all 0, got {weights}", source
        )
    shape = cfg.report.image_shape
    if shape is not None and not (len(shape) in (2, 3) and all(n >= 1 for n in shape)):
        raise ConfigError(
            f"'report.image_shape' must be [H, W] or [C, H, W] of positive sizes, got {shape}",
            source,
        )
    if not cfg.data.inputs:
        raise ConfigError("'data.inputs' must name at least one input", source)
    _validate_hf(cfg)
    _validate_distributed(cfg)
    if cfg.train is not None:
        _validate_train(cfg.train, source)


def _validate_checkpoints(cfg: Config) -> None:
    """model.checkpoints: state dicts instead of model.checkpoint, or peft adapter folders loaded
    in turn onto the one base model (model.checkpoint, model.pretrained), instead of
    model.adapter."""
    model, source = cfg.model, cfg.source
    folders = [Path(c.path).is_dir() for c in model.checkpoints]
    if any(folders) and not all(folders):
        raise ConfigError(
            "'model.checkpoints' mixes adapter folders and state dict files; list one kind", source
        )
    if any(folders) and model.adapter is not None:
        raise ConfigError(
            "set model.adapter or adapter folders in model.checkpoints, not both", source
        )
    if model.checkpoints and not any(folders) and model.checkpoint is not None:
        raise ConfigError("set model.checkpoint or model.checkpoints, not both", source)


def _validate_distributed(cfg: Config) -> None:
    """distributed.shard: fsdp serves one model at a time, through the rules; joining takes time."""
    shard = cfg.distributed.shard
    if not (math.isfinite(cfg.distributed.join_timeout) and cfg.distributed.join_timeout > 0):
        raise ConfigError(
            f"'distributed.join_timeout' must be a positive number of seconds, got "
            f"{cfg.distributed.join_timeout}",
            cfg.source,
        )
    if shard not in (None, "fsdp"):
        raise ConfigError(f"'distributed.shard' must be null or fsdp, got {shard!r}", cfg.source)
    if shard and cfg.model.checkpoints:
        raise ConfigError(
            "'distributed.shard: fsdp' scores one checkpoint; model.checkpoints is not supported "
            "sharded",
            cfg.source,
        )


def _validate_hf(cfg: Config) -> None:
    """The keys for Hugging Face models and tokenized data: keyword inputs, pad, config, pretrained."""
    source, data = cfg.source, cfg.data
    if cfg.model.config is not None and cfg.model.pretrained is not None:
        raise ConfigError(
            "set model.config (random init) or model.pretrained (a saved folder), not both", source
        )
    if isinstance(data.inputs, dict):
        for name in data.inputs:
            if not name.isidentifier():
                raise ConfigError(
                    f"'data.inputs' keys are forward arguments; {name!r} is not a Python name",
                    source,
                )
    columns = list(data.inputs.values() if isinstance(data.inputs, dict) else data.inputs)
    for column, value in data.pad.items():
        if column not in [*columns, data.targets]:
            raise ConfigError(
                f"'data.pad.{column}' names no column of data.inputs or data.targets", source
            )
        if not math.isfinite(value):
            raise ConfigError(f"'data.pad.{column}' must be a finite number, got {value}", source)


def _validate_train(train: TrainConfig, source: str) -> None:
    """``train``: a recipe PyTorch's optimizers take, and a run of at least one step."""
    for key, value, allowed in (
        ("optimizer", train.optimizer, OPTIMIZERS),
        ("schedule", train.schedule, SCHEDULES),
    ):
        if value not in allowed:
            raise ConfigError(
                f"'train.{key}' must be one of {', '.join(allowed)}, got {value!r}", source
            )
    numbers = {"lr": train.lr, "momentum": train.momentum, "eps": train.eps,
               "weight_decay": train.weight_decay}  # fmt: skip
    for key, value in numbers.items():
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"'train.{key}' must be a finite number >= 0, got {value}", source)
    if len(train.betas) != 2 or not all(0 <= b < 1 for b in train.betas):
        raise ConfigError(f"'train.betas' must be two numbers in [0, 1), got {train.betas}", source)
    if train.clip is not None and not (math.isfinite(train.clip) and train.clip > 0):
        raise ConfigError(f"'train.clip' must be a positive number, got {train.clip}", source)
    if train.epochs is not None and train.steps is not None:
        raise ConfigError("set train.epochs or train.steps, not both", source)
    for key in ("epochs", "steps", "batch_size", "save_every"):
        value = getattr(train, key)
        if value is not None and value < 1:
            raise ConfigError(f"'train.{key}' must be at least 1, got {value}", source)
    if train.seed < 0:  # numpy's generators, which draw validate's subsets, take no other
        raise ConfigError(f"'train.seed' must be at least 0, got {train.seed}", source)
    if train.warmup < 0:
        raise ConfigError(f"'train.warmup' must be at least 0, got {train.warmup}", source)
    if train.nesterov and (train.optimizer != "sgd" or train.momentum == 0):
        raise ConfigError("'train.nesterov' needs optimizer sgd with a momentum > 0", source)
    if train.save_every is not None and train.fn is not None:
        raise ConfigError("'train.save_every' is the recipe's; train.fn saves its own", source)
    if train.fn is not None and ":" not in train.fn:
        raise ConfigError(f"'train.fn' must be file.py:function, got {train.fn!r}", source)
