"""The watch's Parquet file: a row per (step, example), written in row groups as steps finish
to a temporary name, moved into place when the watch ends. A resumed run's file goes on the
stopped run's: its rows before the step the run resumes at are copied in first."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torch import Tensor

from ..errors import ConfigError, DataError
from ..inputs import check_output
from ..io.parquet import METADATA_KEY

ROWS_PER_GROUP = 65_536
SAME = ("command", "loss", "reduction", "params")  # what a continued file's run shares
OBSERVED = ("margin", "prob", "pred", "correct")  # in this order, where the loss gives them


def fed(updates: int, batches: float | None, accumulation: int) -> int:
    """The batches a framework's run fed before its optimizer step ``updates`` (where it
    resumes): epochs of ``batches`` batches (None or infinite: an epoch without end), each
    ending in an update over what is left of an accumulation, as the Hugging Face ``Trainer``
    and Lightning step."""
    if batches is None or not math.isfinite(batches):
        return updates * accumulation
    per_epoch = max(math.ceil(batches / accumulation), 1)  # updates an epoch
    return updates // per_epoch * int(batches) + updates % per_epoch * accumulation


class WatchFile:
    """Rows of ``step, epoch, example_id, loss, grad_norm[, margin, prob, pred, correct,
    target], finite``; the schema is the first step's (which columns the loss gives)."""

    def __init__(self, path: Path, metadata: dict[str, Any], fresh: bool = True):
        if not path.parent.is_dir():
            raise DataError("the folder to write the watch file in does not exist", str(path))
        if fresh:  # a file there of the user's, or another command's (a resume reads its own)
            check_output(path, [], "watch", option="out=")
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

    def carry(self, step: int) -> None:
        """A run resumed at ``step``: the rows of the file already at ``path`` (the stopped
        run's) before that step, first; those from it on are dropped, the resumed run writes
        those steps again. No file there: the rows begin at ``step``. The stopped file is read
        once, its batches checked as they are copied: a file that is not the stopped run's
        leaves no temporary file."""
        if step == 0 or not self.path.is_file():
            return
        held: set[int] = set()  # the steps before ``step`` the stopped file holds
        try:
            stopped = pq.ParquetFile(self.path)
            meta = json.loads((stopped.schema_arrow.metadata or {}).get(METADATA_KEY, b"{}"))
            if all(meta.get(k) == self.metadata[k] for k in SAME):
                self._open(stopped.schema_arrow)
                for batch in stopped.iter_batches():
                    kept = batch.filter(pc.less(batch["step"], step))
                    held.update(pc.unique(kept["step"]).to_pylist())
                    self._writer.write_batch(kept)
        except (OSError, pa.ArrowException, ValueError, KeyError) as e:  # no step column
            self.discard()
            raise DataError(f"cannot read the stopped run's watch file: {e}", str(self.path)) from e
        if held != set(range(step)):
            self.discard()
            raise ConfigError(
                f"the run resumes at step {step}, and out holds a watch file that is not the "
                f"stopped run's steps 0-{step - 1} (another loss or parameters, or steps "
                "missing): give another out, or move that file away",
                str(self.path),
            )
        self._names = stopped.schema_arrow.names

    def _open(self, schema: pa.Schema) -> None:
        meta = {METADATA_KEY: json.dumps(self.metadata, default=str)}
        try:
            self._writer = pq.ParquetWriter(self.tmp, schema.with_metadata(meta))
        except OSError as e:
            raise DataError(f"cannot write the watch file: {e}", str(self.path)) from e

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.table({name: np.concatenate(parts) for name, parts in self._pending.items()})
        if self._writer is None:
            self._open(table.schema)
        self._writer.write_table(table.cast(self._writer.schema))
        self._pending, self._rows = {}, 0

    def discard(self) -> None:
        """No file: the rows written so far dropped, the temporary file removed."""
        self._pending, self._rows = {}, 0
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Every row written, the file moved into place; no step: no file."""
        self._flush()
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        os.replace(self.tmp, self.path)
