"""The checks a config's values must pass together, after its types: every bad value is named
by its key path."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import ConfigError
from .schema import DEVICES, DTYPES, Config


def validate(cfg: Config) -> None:
    from ..losses import NAMES as LOSS_NAMES  # imports torch: not for --help, --version, summary

    source = cfg.source
    if not re.fullmatch(r"auto|(cpu|cuda|mps)(:\d+)?", cfg.device):
        raise ConfigError(
            f"'device' must be one of {', '.join(DEVICES)} or cuda:N, got {cfg.device!r}", source
        )
    if cfg.dtype is not None and cfg.dtype not in DTYPES:
        raise ConfigError(f"'dtype' must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}", source)
    if ".py:" not in cfg.loss.name and cfg.loss.name not in LOSS_NAMES:
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
