"""A watched loop's run record (``watchrecord.py``) as the replay opens it: the recorded
optimizer and clip, once nothing was refused while it trained and the config's loss and data
are the ones it watched; the model it began from, built by the config's factory; the random
states its steps began in where the step before did not leave them; and the check that the
config's rows are the data each step fed (``watchdata.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor, nn

from ..config import Config, DataConfig, TrainConfig
from ..errors import ConfigError, DataError, ModelError, one_line
from ..io.data import open_dataset
from ..io.model import build_model
from ..job import resolve_device
from ..resume import as_json, differences
from .loop import TrainingRows
from .record import Record, _load
from .recordfiles import FED, START
from .steps import Update
from .watchdata import check_fed


def opened(meta: dict, cfg: Config, folder: Path) -> tuple[Update, float | None]:
    """The update and clip a watched loop recorded, once the record is one the config can
    replay: nothing refused while it trained, the config's loss, rows enough in its data."""
    if meta["refused"]:
        raise ConfigError(f"the watched run cannot be replayed: {meta['refused']}", str(folder))
    key = as_json({"loss": cfg.to_dict()["loss"], "torch": torch.__version__})
    changed = differences(meta["key"], key)
    if changed:
        raise ConfigError(
            f"the run was watched with a different {', '.join(changed)}: replay it with the "
            "config of the loop's model, data and loss",
            str(folder),
        )
    data = open_dataset(cfg.data)
    n = len(data) if cfg.data.limit is None else min(len(data), cfg.data.limit)
    if meta["rows"] > n:
        raise DataError(
            f"the watch's ids reach row {meta['rows'] - 1}, the config's data has {n} rows: "
            "the ids must be the rows' positions in data.path",
            str(folder),
        )
    recipe = dict(meta["recipe"])
    clip = recipe.pop("clip")
    return Update(TrainConfig(**recipe)), clip


def watched_model(record: Record, cfg: Config) -> nn.Module:
    """``model.factory``'s model with the weights the watched loop began from, training the
    parameters it trained, on the config's device and dtype; the watched module's names less
    ``model.strip_prefix`` (a Lightning module holding the model as ``net``: ``net.``)."""
    model = build_model(dataclasses.replace(cfg.model, checkpoint=None, checkpoints=[]))
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    model = model.to(device=resolve_device(cfg.device), dtype=dtype)
    prefix = cfg.model.strip_prefix or ""
    trained = [name.removeprefix(prefix) for name in record.meta["trained"]]
    start = {name.removeprefix(prefix): w for name, w in _load(record.folder / START).items()}
    try:  # strict: every weight of the watched model, of its shape, and no other
        model.load_state_dict(start)
    except RuntimeError as e:
        raise ModelError(
            f"the watched model's weights do not fit model.factory's model: {one_line(e)}",
            "model.factory",
        ) from e
    names = dict(model.named_parameters())
    for name, p in names.items():
        p.requires_grad_(name in trained)
    if str(names[trained[0]].dtype) != record.meta["dtype"]:
        raise ConfigError(
            f"the watched model trained in {record.meta['dtype']}, the config's model is "
            f"{names[trained[0]].dtype}",
            "dtype",
        )
    return model


def drawn(record: Record) -> dict[int, dict]:
    """Step -> the random state the watched step began in, where the step before did not
    leave it there (the loop drew between its steps); none in a record written before the
    watch kept them (it refused a forward that drew)."""
    if not (record.folder / FED).is_file():
        return {}
    saved = _load(record.folder / FED)
    return dict(zip(saved["drawn"].tolist(), saved["states"], strict=True))


def check_rows(record: Record, rows: TrainingRows, data: DataConfig) -> None:
    """Each step's rows, as the replay batches the config's ``data``, digest as the rows the
    watched step fed: else one line naming the data. Where the loop named its inputs and the
    config maps forward arguments of those names, they are compared by name, in the loop's
    order. (A record written before the watch kept the digests has none: its segments' check
    stands alone.)"""
    if not (record.folder / FED).is_file():
        return
    fed, batch = _load(record.folder / FED)["fed"], rows.batch
    named, arguments = record.meta.get("inputs"), data.inputs
    if named and isinstance(arguments, dict) and sorted(named) == sorted(arguments):
        order = [list(arguments).index(name) for name in named]

        def batch(picked: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
            inputs, targets = rows.batch(picked)
            return tuple(inputs[k] for k in order), targets

    check_fed(fed, record.steps(len(rows))[0], batch, str(record.folder), data.path)
