"""What notebooks and the CLI call: per-example norms of a batch, or of a whole configured dataset."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor, nn

from . import __version__
from .config import Config
from .engine.check import CheckReport, compare_with_loop
from .engine.core import Engine, prepared
from .engine.plan import Plan, build_plan
from .errors import ConfigError
from .io.data import Batch, open_dataset
from .io.model import build_model, file_sha256, import_object
from .io.parquet import ScoreWriter
from .losses import LossFn, resolve_loss


def _as_tuple(inputs: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def per_example_norms(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    loss: str | LossFn = "cross_entropy",
    *,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    output: str | int | None = None,
) -> Tensor:
    """(B,) L2 norm of each example's own loss gradient over the selected parameters.

    ``inputs`` is a tensor or a tuple of tensors passed to ``model(*inputs)``; ``loss`` is a name
    (cross_entropy, nll, mse, l1, bce_with_logits) or a callable ``(outputs, targets) -> Tensor[B]``.
    The model's ``.grad`` fields, hooks and train/eval mode are left as they were.
    """
    plan = build_plan(model, include, exclude)
    engine = Engine(model, resolve_loss(loss), plan, output)
    with prepared(model, plan):
        scores = engine.norms(_as_tuple(inputs), targets)
    return torch.stack(list(scores.norm_sq.values())).double().sum(0).sqrt()


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA, then MPS, then the CPU; an unavailable device is an error."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available here", "device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' asked for, but MPS is not available here", "device")
    return torch.device(name)


def config_loss(cfg: Config) -> LossFn:
    name = cfg.loss.name
    spec = import_object(name, "loss.name") if ".py:" in name else name
    return resolve_loss(spec, cfg.loss.kwargs, cfg.loss.class_dim, cfg.loss.token_reduction)


@dataclass
class Job:
    """A configured model and dataset, ready to score."""

    cfg: Config
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    plan: Plan
    engine: Engine

    @classmethod
    def from_config(cls, cfg: Config, trust_checkpoint: bool = False) -> Job:
        device = resolve_device(cfg.device)
        model = build_model(cfg.model, trust_checkpoint)
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else next(model.parameters()).dtype
        model.to(device=device, dtype=dtype)
        plan = build_plan(model, cfg.params.include, cfg.params.exclude)
        return cls(
            cfg, model, device, dtype, plan, Engine(model, config_loss(cfg), plan, cfg.model.output)
        )

    def to_device(self, batch: Batch) -> tuple[tuple[Tensor, ...], Tensor]:
        def move(t: Tensor) -> Tensor:
            return t.to(self.device, self.dtype if t.is_floating_point() else None)

        return tuple(move(t) for t in batch.inputs), batch.targets.to(self.device)

    def metadata(self, command: str) -> dict:
        ckpt = self.cfg.model.checkpoint
        return {
            "version": __version__,
            "command": command,
            "config": self.cfg.to_dict(),
            "torch": torch.__version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "checkpoint_sha256": file_sha256(ckpt) if ckpt else None,
            "plan": self.plan.describe(),
        }


def _arrow_type(values: np.ndarray | Tensor) -> pa.DataType:
    dtype = values.numpy().dtype if isinstance(values, Tensor) else values.dtype
    return pa.string() if dtype.kind in "OUS" else pa.from_numpy_dtype(dtype)


def norms_columns(job: Job, batch: Batch) -> dict[str, np.ndarray]:
    """One batch's rows: example_id, id, loss, grad_norm, grad_norm/<module>, target, finite."""
    scores = job.engine.norms(*job.to_device(batch))
    total = torch.stack(list(scores.norm_sq.values())).double().sum(0)
    columns: dict[str, np.ndarray] = {"example_id": batch.index.numpy()}
    if batch.ids is not None:
        columns["id"] = batch.ids
    loss = scores.loss.double().cpu()
    columns["loss"] = loss.numpy()
    columns["grad_norm"] = total.sqrt().cpu().numpy()
    if job.cfg.output.per_layer:
        per_module: dict[str, Tensor] = {}
        for p in job.plan.included:
            per_module[p.module] = per_module.get(p.module, 0) + scores.norm_sq[p.name].double()
        for module in job.plan.modules:
            columns[f"grad_norm/{module}"] = per_module[module].sqrt().cpu().numpy()
    if batch.targets.dim() == 1:
        columns["target"] = batch.targets.numpy()
    columns["finite"] = (torch.isfinite(loss) & torch.isfinite(total.cpu())).numpy()
    return columns


def score_dataset(
    cfg: Config,
    command: str = "norms",
    score_batch: Callable[[Job, Batch], dict[str, np.ndarray]] = norms_columns,
    *,
    trust_checkpoint: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path:
    """Score every example of ``cfg``'s dataset with ``score_batch`` and write the Parquet file.

    The first batch runs before anything is written, so input the model cannot take leaves no file.
    """
    job = Job.from_config(cfg, trust_checkpoint)
    dataset = open_dataset(cfg.data)
    total = len(dataset) if cfg.data.limit is None else min(len(dataset), cfg.data.limit)
    if on_start:
        on_start(total)
    with contextlib.ExitStack() as stack:
        stack.enter_context(prepared(job.model, job.plan))
        writer = None
        for batch in dataset.batches(cfg.data.batch_size, cfg.data.limit):
            columns = score_batch(job, batch)
            if writer is None:
                schema = pa.schema(
                    [(name, _arrow_type(values)) for name, values in columns.items()]
                )
                writer = stack.enter_context(
                    ScoreWriter(cfg.output.path, schema, job.metadata(command))
                )
            writer.write(columns)
            if on_batch:
                on_batch(len(batch.index))
    return Path(cfg.output.path)


def check_config(cfg: Config, examples: int = 8, *, trust_checkpoint: bool = False) -> CheckReport:
    """The configured model on its first ``examples`` examples: fast engine vs per-example loop."""
    if examples < 1:
        raise ConfigError(f"--examples must be at least 1, got {examples}", "--examples")
    job = Job.from_config(cfg, trust_checkpoint)
    batch = next(open_dataset(cfg.data).batches(examples, examples))
    with prepared(job.model, job.plan):
        return compare_with_loop(job.engine, *job.to_device(batch))
