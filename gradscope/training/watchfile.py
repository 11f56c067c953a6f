"""The watch's Parquet file: a row per (step, example), written in row groups as steps finish
to a temporary name, moved into place when the watch ends."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch import Tensor

from ..errors import DataError
from ..io.parquet import METADATA_KEY

ROWS_PER_GROUP = 65_536
OBSERVED = ("margin", "prob", "pred", "correct")  # in this order, where the loss gives them


class WatchFile:
    """Rows of ``step, epoch, example_id, loss, grad_norm[, margin, prob, pred, correct,
    target], finite``; the schema is the first step's (which columns the loss gives)."""

    def __init__(self, path: Path, metadata: dict[str, Any]):
        if not path.parent.is_dir():
            raise DataError("the folder to write the watch file in does not exist", str(path))
        self.path, self.metadata = path, metadata
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        self._writer: pq.ParquetWriter | None = None
        self._pending: dict[str, list[np.ndarray]] = {}  # column -> its steps' values
        self._rows = 0
        self._names: list[str] = []  # the first step's columns, every step's

    def write(
        self,
        step: int,
        epoch: int,
        ids: np.ndarray,
        loss: Tensor,
        grad_norm: Tensor,
        observed: dict[str, Tensor],
        targets: Tensor,
    ) -> None:
        """One step's rows, kept until a row group fills."""
        n = len(ids)
        loss_np, norm_np = loss.numpy(), grad_norm.double().numpy()
        columns: dict[str, np.ndarray] = {
            "step": np.full(n, step, np.int64),
            "epoch": np.full(n, epoch, np.int64),
            "example_id": ids.astype(np.int64),
            "loss": loss_np,
            "grad_norm": norm_np,
        }
        for name in OBSERVED:
            if name in observed:
                values = observed[name].cpu().numpy()
                columns[name] = values.astype(np.int64 if name == "pred" else np.float64)
        if "pred" in observed and targets.dim() == 1 and not targets.is_floating_point():
            columns["target"] = targets.cpu().numpy().astype(np.int64)
        columns["finite"] = np.isfinite(loss_np) & np.isfinite(norm_np)
        self._names = self._names or list(columns)
        if list(columns) != self._names:
            raise DataError(
                f"step {step} gives columns {', '.join(columns)}, the steps before "
                f"{', '.join(self._names)}: a watch file holds one kind of batch",
                str(self.path),
            )
        for name, values in columns.items():  # one Arrow table a row group: not one a step
            self._pending.setdefault(name, []).append(values)
        self._rows += n
        if self._rows >= ROWS_PER_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.table({name: np.concatenate(parts) for name, parts in self._pending.items()})
        if self._writer is None:
            meta = {METADATA_KEY: json.dumps(self.metadata, default=str)}
            try:
                self._writer = pq.ParquetWriter(self.tmp, table.schema.with_metadata(meta))
            except OSError as e:
                raise DataError(f"cannot write the watch file: {e}", str(self.path)) from e
        self._writer.write_table(table.cast(self._writer.schema))
        self._pending, self._rows = {}, 0

    def close(self) -> None:
        """Every row written, the file moved into place; no step: no file."""
        self._flush()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        os.replace(self.tmp, self.path)
