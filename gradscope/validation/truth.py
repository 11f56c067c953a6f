"""The ground truth: the models retrained on random subsets of the training rows (and with rows
removed), each reference example's loss and margin under each, kept in one Parquet file.

One row per trained model: ``kind`` (``subset``, ``full``, ``removed``, ``random``), ``subset``
(its number, else -1), ``ref`` (the reference a removal is for; -1 for the mean over REF or
none), ``seed`` (passed to ``fit``), ``rows`` (the training rows it was trained on), ``loss`` and
``margin`` (one per reference example; margin NaN where the loss has no single label) and
``seconds`` (its training time). The ``gradscope`` metadata key holds ``identity`` (what a
model depends on: recipe, model factory, loss, data and REF sha256) and ``design`` (subsets,
fraction, seeds and the rule that drew the subsets).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..config import Config
from ..errors import ConfigError, DataError, one_line
from ..io.code import config_code
from ..io.data import code_file, data_identity
from ..io.files import file_sha256
from ..io.parquet import read_metadata
from ..resume import as_json, differences

RULE = (
    "subset m (m = 0, 1, ...): numpy.random.default_rng([train.seed, 0]).choice(N, size, "
    "replace=False) drawn M times in turn, sorted; random removal for reference r: "
    "default_rng([train.seed, 1, r + 1]).choice(N, K, replace=False)"
)
SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("subset", pa.int64()),
        ("ref", pa.int64()),
        ("seed", pa.int64()),
        ("rows", pa.list_(pa.int64())),
        ("loss", pa.list_(pa.float64())),
        ("margin", pa.list_(pa.float64())),
        ("seconds", pa.float64()),
    ]
)


@dataclass(frozen=True, eq=False)
class Task:
    """One model to train: ``fit(cfg, rows, seed=seed)``."""

    kind: str
    subset: int
    ref: int
    seed: int
    rows: np.ndarray  # (n,) sorted training rows

    @property
    def key(self) -> tuple[int, str]:
        """What makes two tasks the same model: the seed and the rows."""
        return self.seed, hashlib.sha256(self.rows.astype(np.int64).tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class Model:
    """A trained model's outputs on REF."""

    task: Task
    loss: np.ndarray  # (R,)
    margin: np.ndarray  # (R,)
    seconds: float

    def columns(self) -> dict[str, pa.Array]:
        """The model as one row of the truth file."""
        t = self.task
        values = {
            "kind": [t.kind],
            "subset": [t.subset],
            "ref": [t.ref],
            "seed": [t.seed],
            "rows": [t.rows.tolist()],
            "loss": [self.loss.tolist()],
            "margin": [self.margin.tolist()],
            "seconds": [self.seconds],
        }
        return {f.name: pa.array(values[f.name], f.type) for f in SCHEMA}


def subsets(seed: int, rows: int, fraction: float, count: int) -> list[np.ndarray]:
    """``count`` subsets of ``round(fraction * rows)`` rows, drawn by RULE."""
    size = round(fraction * rows)
    rng = np.random.default_rng([seed, 0])
    return [np.sort(rng.choice(rows, size, replace=False)) for _ in range(count)]


def random_removal(seed: int, rows: int, k: int, ref: int) -> np.ndarray:
    """The ``k`` rows dropped at random for reference ``ref`` (-1: the mean over REF), by RULE."""
    return np.sort(np.random.default_rng([seed, 1, ref + 1]).choice(rows, k, replace=False))


def identity(cfg: Config, ref: str, rows: int, same_order: bool = False) -> dict[str, Any]:
    """What every retrained model depends on, portable between machines: the recipe, the model
    factory and its kwargs, the loss, the dtype, the data's columns, padding and sha256 (where
    code makes the rows, theirs: ``io.data.data_identity``), REF's
    sha256; each file the config names by its sha256 (never its path). ``model.checkpoint`` is
    not in it: a retrain starts afresh. ``order: same`` when every model trains on every
    row in the full run's batches, the rows it leaves out weighted 0."""
    model = dataclasses.asdict(cfg.model)
    for key in ("checkpoint", "checkpoints"):
        model.pop(key)
    data = {
        "sha256": data_identity(cfg.data),  # where code makes the rows, theirs
        "rows": rows,
        "inputs": cfg.data.inputs,
        "targets": cfg.data.targets,
        "pad": cfg.data.pad,
    }
    if cfg.data.pad_targets is not None:  # absent before it was a key: those truths stand
        data["pad_targets"] = cfg.data.pad_targets
    if cfg.train.batch_size is None:  # the recipe's batches are data.batch_size's
        data["batch_size"] = cfg.data.batch_size
    train = dataclasses.asdict(cfg.train)
    train.pop("save_every")  # epoch checkpoints of gradscope train: not the model's weights
    found = {
        "train": train,
        "model": model,
        "loss": dataclasses.asdict(cfg.loss),
        "dtype": cfg.dtype,
        "data": data,
        "ref": {"sha256": data_identity(cfg.data, ref)},
    }
    # the code the factory (and data, loss, loop) load from beside them, file by file: a
    # module a factory imports, changed, makes other models as its own file does
    found["code"] = config_code(cfg)
    if same_order:  # absent, each subset trained alone: the truth files made before it
        found["order"] = "same"
    return as_json(_portable(found))


def _portable(value: Any) -> Any:
    """Paths replaced by their files' sha256: ``file.py:Name`` by the name and the file's."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and code_file(value) and os.path.isfile(code_file(value)):
        return f"{value.rsplit(':', 1)[1]} in sha256:{file_sha256(code_file(value))}"
    if isinstance(value, str) and os.path.isabs(value) and os.path.exists(value):
        return f"sha256:{file_sha256(value)}"
    return value


@dataclass
class Truth:
    """The models of a truth file, found by their task's key."""

    identity: dict[str, Any]
    design: dict[str, Any]
    models: list[Model]

    def __post_init__(self) -> None:
        self._by_key = {m.task.key: m for m in self.models}

    def find(self, task: Task) -> Model | None:
        return self._by_key.get(task.key)

    def add(self, model: Model) -> None:
        if model.task.key not in self._by_key:
            self.models.append(model)
            self._by_key[model.task.key] = model

    def metadata(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "command": "validate",
            "identity": self.identity,
            "design": self.design,
        }


def read_truth(path: Path, identity: dict[str, Any]) -> Truth:
    """The truth file at ``path``, refused (a ConfigError naming the keys) when it was made for
    another recipe, model, loss, data or REF than ``identity`` says."""
    meta = read_metadata(path)
    if not isinstance(meta.get("identity"), dict) or not isinstance(meta.get("design"), dict):
        raise DataError("not a truth file gradscope validate wrote: no identity", str(path))
    keys = differences(meta["identity"], identity)
    if keys:
        raise ConfigError(
            f"the truth file was made with a different {', '.join(keys)}; remove it or choose "
            "another --truth",
            str(path),
        )
    try:
        table = pq.read_table(path, schema=SCHEMA)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"not a readable truth file: {one_line(e)}", str(path)) from e
    rows = table.to_pylist()
    models = [
        Model(
            Task(r["kind"], r["subset"], r["ref"], r["seed"], np.array(r["rows"], np.int64)),
            np.array(r["loss"], np.float64),
            np.array(r["margin"], np.float64),
            r["seconds"],
        )
        for r in rows
    ]
    return Truth(meta["identity"], meta["design"], models)
