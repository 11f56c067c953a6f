"""YAML config -> frozen, validated dataclasses; every bad value is named by its key path:
the keys, each section with the check of its own values (``schema.py``, ``train.py``), built by
type (``typed.py``), checked together (``validate.py``), read and resolved (``load.py``)."""

from .load import (
    check_counts,
    config_from_dict,
    default_pad,
    load_config,
    output_path,
    padded_by_default,
    with_overrides,
)
from .schema import (
    DEVICES,
    DTYPES,
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    LossConfig,
    ModelConfig,
    OutputConfig,
    ParamsConfig,
    ReportConfig,
    SummaryConfig,
)
from .train import OPTIMIZERS, SCHEDULES, TrainConfig

__all__ = [
    "DEVICES",
    "DTYPES",
    "OPTIMIZERS",
    "SCHEDULES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "LossConfig",
    "ModelConfig",
    "OutputConfig",
    "ParamsConfig",
    "ReportConfig",
    "SummaryConfig",
    "TrainConfig",
    "check_counts",
    "config_from_dict",
    "default_pad",
    "padded_by_default",
    "load_config",
    "output_path",
    "with_overrides",
]
