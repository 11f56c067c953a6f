"""What notebooks and the CLI call: per-example norms of a batch, or of a whole configured dataset."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from . import __version__, distributed
from .config import Config
from .engine.core import Engine, prepared
from .engine.plan import Plan, build_plan
from .errors import ConfigError, Interrupted
from .io.data import Batch, open_dataset
from .io.model import build_model, file_sha256, import_object
from .io.parquet import PartialRun
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


def _fingerprint(cfg: Config, command: str) -> dict:
    """What a partial run must share with the run that resumes it, as JSON reads it back."""
    config = cfg.to_dict()
    for key in ("summary", "source", "device"):  # display, file name, placement (ranks differ)
        config.pop(key)
    ckpt = cfg.model.checkpoint
    fingerprint = {
        "command": command,
        "config": config,
        "checkpoint_sha256": file_sha256(ckpt) if ckpt else None,
    }
    return json.loads(json.dumps(fingerprint, default=str))


def _differences(old: object, new: object, key: str = "") -> list[str]:
    """The dotted keys at which two JSON values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for k in sorted(set(old) | set(new))
            for d in _differences(old.get(k), new.get(k), f"{key}.{k}" if key else k)
        ]
    return [] if old == new else [key]


def score_dataset(
    cfg: Config,
    command: str = "norms",
    score_batch: Callable[[Job, Batch], dict[str, np.ndarray]] = norms_columns,
    *,
    trust_checkpoint: bool = False,
    resume: bool = False,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path | None:
    """Score every example of ``cfg``'s dataset with ``score_batch`` and write the Parquet file.

    Each batch's rows become a part file in the partial folder as soon as they are scored (see
    ``io/parquet.py``); with ``resume`` the parts of an interrupted run with the same command,
    config and checkpoint are kept and only the missing batches are scored. Under torchrun, rank r
    scores batches r, r + K, ... and rank 0 assembles the file; other ranks return None.
    The first batch runs before anything is written, so input the model cannot take leaves no file.
    ``on_start`` gets the number of rows this process scores, None when unknown before reading.
    """
    with distributed.session() as world:
        job = Job.from_config(
            dataclasses.replace(cfg, device=world.device(cfg.device)), trust_checkpoint
        )
        dataset = open_dataset(cfg.data)
        run = PartialRun(cfg.output.path)
        fingerprint = _fingerprint(cfg, command)
        saved = run.manifest() if resume else None
        if saved is not None and saved["fingerprint"] != fingerprint:
            keys = _differences(saved["fingerprint"], fingerprint)
            raise ConfigError(
                f"cannot resume: the interrupted run had a different {', '.join(keys)}; "
                "run without --resume to start over",
                str(run.dir),
            )
        done = run.done() if saved is not None else set()
        total = dataset.length
        if total is not None and cfg.data.limit is not None:
            total = min(total, cfg.data.limit)
        if on_start:
            on_start(world.rows(total, cfg.data.batch_size))

        def start() -> None:
            """Once every rank's first batch has run: begin the partial folder, or keep it."""
            distributed.barrier()
            if world.main and saved is None:
                run.start({"fingerprint": fingerprint, "metadata": job.metadata(command)})
            distributed.barrier()

        started, rows, number = False, 0, -1
        with prepared(job.model, job.plan):
            try:
                for number, batch in enumerate(
                    dataset.batches(cfg.data.batch_size, cfg.data.limit)
                ):
                    if not world.owns(number):
                        continue
                    if number not in done:
                        columns = score_batch(job, batch)
                        if not started:
                            start()
                            started = True
                        run.write(number, columns)
                    rows += len(batch)
                    if on_batch:
                        on_batch(len(batch))
            except KeyboardInterrupt:
                raise Interrupted(
                    f"interrupted with {rows} examples saved; run the same command with --resume "
                    "to continue",
                    str(run.dir),
                ) from None
        if not started:
            start()
        distributed.barrier()  # every rank's parts are written
        return run.assemble(number + 1) if world.main else None
