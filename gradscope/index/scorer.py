"""The ``index`` command's scorer: each example's projected gradient, one row of the index."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..config import Config, output_path
from ..curvature.made import SETTINGS, plain
from ..engine import Want
from ..errors import ConfigError
from ..inputs import Inputs, config_inputs
from ..io.data import Batch
from ..io.files import file_sha256
from ..io.held import identity, is_held
from ..job import Job
from ..rules.base import accumulation_dtype
from ..scorers.base import Scorer, leading
from . import layout
from .projection import DEFAULT_DIM, Projector, blocks

STORAGE = ("float16", "float32")
# the files that make the model and its loss: a query's model must be the indexed one
MODEL_FILES = (
    "model.factory",
    "model.pretrained",
    "model.checkpoint",
    "model.adapter",
    "loss.name",
)
# the other keys that change the gradients: a query's --config must agree with the index on each
GRADIENT_KEYS = (
    *SETTINGS,  # the model's and the loss's, as a factors file's
    "dtype",
    "params.include",
    "params.exclude",
    "data.pad",
    "data.pad_targets",
)


def index_output(cfg: Config, out: str | None) -> Config:
    """``cfg`` writing the index folder ``out`` (a trailing '/' allowed), by default
    ``output.path`` with ``.index`` for its suffix."""
    if out is None:
        path = str(Path(cfg.output.path).with_suffix(".index"))
    else:
        path = output_path(out.rstrip("/") or out, Path.cwd(), "--out")
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=path))


def one_checkpoint(cfg: Config) -> None:
    """An index holds the gradients at one checkpoint: ``model.checkpoints`` is refused, in
    ``index`` and in a ``query`` (whose references would be taken at others)."""
    if cfg.model.checkpoints:
        raise ConfigError(
            "an index holds the gradients at one checkpoint; model.checkpoints lists "
            f"{len(cfg.model.checkpoints)}: index (and query) each with model.checkpoint",
            "model.checkpoints",
        )


def model_files(cfg: Config) -> dict[str, str]:
    """{config key: sha256} of the files that make ``cfg``'s model and loss; of a model held in
    Python (the API's), its weights' (``io.held.identity``)."""
    files = {
        key: file_sha256(path) for key, path in config_inputs(cfg.to_dict()) if key in MODEL_FILES
    }
    held_model = (
        {"model.factory": identity(cfg.model.factory)} if is_held(cfg.model.factory) else {}
    )
    return files | held_model


def gradient_keys(cfg: Config) -> dict[str, str]:
    """{key: sha256 of its value} of each of ``GRADIENT_KEYS``; a ``file.py:Name`` by its name
    alone (the file itself is compared by ``model_files``, wherever it lies)."""
    raw, out = cfg.to_dict(), {}
    for key in GRADIENT_KEYS:
        section, _, name = key.rpartition(".")
        value = plain(key, raw[section][name] if section else raw[name])  # weights: model_files'
        text = json.dumps(value, sort_keys=True, default=str)
        out[key] = hashlib.sha256(text.encode()).hexdigest()
    return out


def reused(
    buffer: torch.Tensor | None, batch: int, width: int, like: dict[str, torch.Tensor]
) -> torch.Tensor:
    """A (batch, width) buffer like ``like``'s tensors: ``buffer`` again where it fits. A fresh
    buffer of each batch's rows cost more in page faults than filling it (W1: 7 of 31 ms)."""
    first = next(iter(like.values()))
    fits = buffer is not None and buffer.shape == (batch, width)
    if fits and (buffer.dtype, buffer.device) == (first.dtype, first.device):
        return buffer
    return first.new_empty(batch, width)


class IndexScorer(Scorer):
    """example_id, id, loss, norm and finite, and each example's projected gradient
    ``phi_i / ||phi_i||`` as one row of ``storage`` floats (see ``layout.py``).

    ``dim`` bounds each parameter's block (``projection.py``); ``seed`` draws the factors.
    """

    command = "index"

    def __init__(self, dim: int | None = None, seed: int = 0, storage: str = "float16"):
        super().__init__()
        dim = DEFAULT_DIM if dim is None else dim
        if dim < 1:
            raise ConfigError(f"--dim must be at least 1, got {dim}", "--dim")
        if storage not in STORAGE:
            raise ConfigError(f"--storage must be float16 or float32, got {storage!r}", "--storage")
        self.dim, self.seed, self.storage = dim, seed, storage
        self.projector: Projector | None = None
        self._want: Want | None = None
        self._files: dict[str, str] = {}
        self._gradients: dict[str, str] = {}
        self._rows: torch.Tensor | None = None  # a batch's rows, the buffer kept (see reused)

    def resume_key(self, cfg: Config) -> dict:
        return {"dim": self.dim, "seed": self.seed, "storage": self.storage}

    def check_output(self, path: str, inputs: Inputs) -> None:
        layout.check_output(path, inputs)

    def partial(self, path: str, fingerprint: dict) -> layout.IndexRun:
        return layout.IndexRun(path, fingerprint)

    def setup(self, job: Job) -> None:
        one_checkpoint(job.cfg)
        made = blocks(job.plan, self.dim)
        self.projector = Projector(made, self.seed, job.device, accumulation_dtype(job.dtype))
        self._want = Want(norms=False, project=self.projector.projections)
        self._files, self._gradients = model_files(job.cfg), gradient_keys(job.cfg)

    def columns(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        scores = job.engine.scores(*job.to_device(batch), self._want)
        self._rows = reused(self._rows, scores.loss.shape[0], self.projector.width, scores.inner)
        phi = self.projector.rows(scores.inner, self._rows)  # (B, width)
        norm = torch.linalg.vector_norm(phi, dim=1, dtype=torch.float64)  # (B,)
        loss = scores.loss.double()
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        keep = (finite & (norm > 0))[:, None]
        unit = torch.where(keep, phi / norm.to(phi.dtype).clamp_min(1e-300)[:, None], 0)
        columns = leading(batch)
        columns["loss"] = loss.cpu().numpy()
        columns["norm"] = norm.cpu().numpy()
        columns["finite"] = finite.cpu().numpy()
        columns[layout.ROWS] = layout.row_bytes(unit.to(getattr(torch, self.storage)).cpu().numpy())
        return columns

    def metadata(self) -> dict:
        index = self.projector.describe() | {"dim": self.dim, "storage": self.storage}
        return {"index": index, "model_files": self._files, "gradients": self._gradients}
