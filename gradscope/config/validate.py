"""A config's values checked after its types: each section's keys by themselves (its ``check``,
beside its fields), then the keys that must agree with each other; every bad value is named by
its key path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import ConfigError
from .schema import Config
from .train import TrainConfig

# the recipe's keys, which train.fn (a loop of the user's own) does not read: all but its seed,
# the weights it starts from, and save_every (refused with train.fn on its own)
RECIPE = tuple(
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.name not in ("seed", "init", "save_every", "fn")
)


def validate(cfg: Config) -> None:
    sections = (cfg, cfg.model, cfg.data, cfg.loss, cfg.distributed, cfg.output, cfg.summary,
                cfg.report, cfg.train)  # fmt: skip
    for section in sections:
        if section is not None:
            section.check(cfg.source)
    _agree_model(cfg)
    _agree_data(cfg)
    _agree_train(cfg)


def _agree_model(cfg: Config) -> None:
    """model.checkpoints: state dicts instead of model.checkpoint, or peft adapter folders loaded
    in turn onto the one base model (model.checkpoint, model.pretrained), instead of
    model.adapter; fsdp serves one model at a time."""
    model, source = cfg.model, cfg.source
    folders = any(Path(c.path).is_dir() for c in model.checkpoints)  # all of them, or none
    if folders and model.adapter is not None:
        raise ConfigError(
            "set model.adapter or adapter folders in model.checkpoints, not both", source
        )
    if model.checkpoints and not folders and model.checkpoint is not None:
        raise ConfigError("set model.checkpoint or model.checkpoints, not both", source)
    if model.config is not None and model.pretrained is not None:
        raise ConfigError(
            "set model.config (random init) or model.pretrained (a saved folder), not both", source
        )
    if cfg.distributed.shard and model.checkpoints:
        raise ConfigError(
            "'distributed.shard: fsdp' scores one checkpoint; model.checkpoints is not supported "
            "sharded",
            source,
        )


def _agree_data(cfg: Config) -> None:
    """data.pad: columns the model or the loss reads."""
    data = cfg.data
    columns = list(data.inputs.values() if isinstance(data.inputs, dict) else data.inputs)
    for column in data.pad:
        if column not in [*columns, data.targets]:
            raise ConfigError(
                f"'data.pad.{column}' names no column of data.inputs or data.targets", cfg.source
            )


def _agree_train(cfg: Config) -> None:
    """``train``: one length of run, and the keys that belong to one optimizer or one loop."""
    train, source = cfg.train, cfg.source
    if train is None:
        return
    if train.epochs is not None and train.steps is not None:
        raise ConfigError("set train.epochs or train.steps, not both", source)
    if train.nesterov and (train.optimizer != "sgd" or train.momentum == 0):
        raise ConfigError("'train.nesterov' needs optimizer sgd with a momentum > 0", source)
    if train.save_every is not None and train.fn is not None:
        raise ConfigError("'train.save_every' is the recipe's; train.fn saves its own", source)
    defaults = TrainConfig()
    unread = [k for k in RECIPE if getattr(train, k) != getattr(defaults, k)]
    if train.fn is not None and unread:
        raise ConfigError(f"'train.{unread[0]}' is the recipe's; train.fn does not read it", source)
    other = {"sgd": ("betas", "eps")}.get(train.optimizer, ("momentum",))
    unread = [k for k in other if k in unread]
    if unread:
        raise ConfigError(
            f"'train.{unread[0]}' is not optimizer {train.optimizer}'s: it would not be read",
            source,
        )
