"""The configured job: the model at its checkpoint on its device, with its loss and its engine."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from . import __version__, distributed
from .config import Config, ModelConfig
from .engine import (
    CheckReport,
    Engine,
    Forward,
    Plan,
    compare_with_loop,
    computed_in,
    influence_errors,
)
from .errors import ConfigError, DataError, ModelError, reading
from .io.data import Batch, data_identity, open_dataset
from .io.files import file_sha256
from .io.held import held, is_held
from .io.model import build_model, import_object
from .losses import LossFn, resolve_loss
from .predictions import predictions


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


def at_checkpoint(model: ModelConfig, path: str) -> ModelConfig:
    """The model of one entry of ``model.checkpoints``: a peft adapter folder loaded onto the
    same base (TracIn over a LoRA run), else a state dict."""
    key = "adapter" if Path(path).is_dir() else "checkpoint"
    return dataclasses.replace(model, checkpoints=[], **{key: path})


def config_loss(cfg: Config, alone: bool = True) -> LossFn:
    """The config's loss; ``alone``: a loss of the user's checked against examples alone (not
    where it only trains: ``losses.resolve_loss``)."""
    name = cfg.loss.name
    spec = held(name) if is_held(name) else name
    spec = import_object(name, "loss.name") if ".py:" in name else spec
    loss = cfg.loss
    return resolve_loss(spec, loss.kwargs, loss.class_dim, loss.token_reduction, alone=alone)


def config_forward(cfg: Config) -> Forward:
    """How the configured model is called: a mapping ``{forward_argument: column}`` in
    ``data.inputs`` passes those inputs by keyword; ``model.output`` picks the loss's input."""
    inputs = cfg.data.inputs
    keywords = tuple(inputs) if isinstance(inputs, dict) else ()
    return Forward(keywords=keywords, output=cfg.model.output)


@dataclass
class Job:
    """A configured model and dataset, ready to score."""

    cfg: Config
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    engine: Engine
    sharded: str | None = None  # how the model is sharded over the ranks, once it is

    @classmethod
    def from_config(cls, cfg: Config, trust_checkpoint: bool = False) -> Job:
        """Build the model at ``model.checkpoint``, or at the last of ``model.checkpoints``."""
        device = resolve_device(cfg.device)
        model_cfg = cfg.model
        if model_cfg.checkpoints:
            model_cfg = at_checkpoint(model_cfg, model_cfg.checkpoints[-1].path)
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
            torch.manual_seed(0)  # weights no checkpoint sets: the same on every rank and resume
            model = (
                held(model_cfg.factory)  # a model the API's caller passed, as it is
                if is_held(model_cfg.factory)
                else build_model(model_cfg, trust_checkpoint)
            )
        first = next(model.parameters(), None)
        if first is None:
            raise ModelError("the model has no parameters: no gradient to score", "model.factory")
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else first.dtype
        kinds = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
        if is_held(model_cfg.factory) and not cfg.dtype and len(kinds) > 1:  # cast, said nowhere
            raise ModelError(
                f"the model's parameters are of several dtypes ({', '.join(kinds)}): pass dtype= "
                "to score it in one (its own weights are left as they are)",
                "dtype",
            )
        # a model to shard stays on the CPU, whole, until shard() moves each rank's part
        sharded = cfg.distributed.shard and distributed.world().size > 1
        model.to(device=None if sharded else device, dtype=dtype)
        engine = Engine(
            model,
            config_loss(cfg),
            cfg.params.include,
            cfg.params.exclude,
            config_forward(cfg),
            predictions(cfg.loss.name, cfg.loss.kwargs),  # pred, prob, margin from the forward
        )
        return cls(cfg, model, device, dtype, engine)

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    def to_device(
        self, batch: Batch, device: torch.device | None = None
    ) -> tuple[tuple[Tensor, ...], Tensor]:
        device = device or self.device

        def move(t: Tensor) -> Tensor:
            return t.to(device, self.dtype if t.is_floating_point() else None)

        return tuple(move(t) for t in batch.inputs), batch.targets.to(device)

    def shard(self, first: Batch) -> None:
        """``distributed.shard: fsdp`` under torchrun: decide on the whole model with the first
        batch (on the CPU, where the model was built), then shard it over the ranks with FSDP2
        and move each rank's part to its device (see ``fsdp.py``)."""
        from . import fsdp

        fsdp.decide(self.engine, *self.to_device(first, torch.device("cpu")))
        blocks = fsdp.shard(self.model, self.device, self.cfg.distributed.wrap)
        self.engine.rebind()
        size = distributed.world().size
        self.sharded = f"fsdp: {blocks} blocks and the root over {size} ranks"

    def at_checkpoint(self, path: str, trust_checkpoint: bool = False) -> Job:
        """The same job with the model's weights from ``path``: one step of a TracIn sum."""
        model = at_checkpoint(self.cfg.model, path)
        return Job.from_config(dataclasses.replace(self.cfg, model=model), trust_checkpoint)

    def metadata(self, command: str) -> dict:
        """The job's part of the output's ``gradscope`` key; the plan as it stands now."""
        model = self.cfg.model
        if model.checkpoints:  # the model is at the last one
            model = at_checkpoint(model, model.checkpoints[-1].path)
        ckpt = model.checkpoint or model.pretrained  # a save_pretrained folder: its weights
        return {
            "version": __version__,
            "command": command,
            "config": self.cfg.to_dict(),
            "torch": torch.__version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            # the coarsest the last pass's layers computed in: autocast's bfloat16 under
            # float32 weights, whose rounding the numbers carry
            "computed_in": str(computed_in() or self.dtype).removeprefix("torch."),
            "checkpoint_sha256": file_sha256(ckpt) if ckpt else None,
            "data_sha256": data_identity(self.cfg.data),  # the report checks it is unchanged
            "adapter_sha256": file_sha256(model.adapter) if model.adapter else None,
            "params": self.plan.describe_selection(),
            "sharded": self.sharded,
            "plan": self.plan.describe(),
        }


def check_config(
    cfg: Config, examples: int = 8, *, ref: str | None = None, trust_checkpoint: bool = False
) -> CheckReport:
    """The configured model on its first ``examples`` examples: both engines vs the per-example loop.

    Influence is checked against the mean gradient of the first ``examples`` rows of ``ref``, or
    of the checked examples themselves when no reference is given.
    """
    if examples < 1:
        raise ConfigError(f"--examples must be at least 1, got {examples}", "--examples")
    job = Job.from_config(cfg, trust_checkpoint)
    with job.engine:
        batch, skipped = _finite(job, next(open_dataset(cfg.data).batches(examples, examples)))
        reference = batch
        if ref is not None:
            rows = next(open_dataset(cfg.data, ref, "--ref").batches(examples, examples))
            with reading(f"--ref {ref}"):
                reference, _ = _finite(job, rows, ref)
        report = compare_with_loop(job.engine, *batch)
    with reading(f"--ref {ref}") if ref is not None else contextlib.nullcontext():
        report.influence = influence_errors(job.engine, *batch, *reference)
    report.non_finite = skipped
    return report


def _finite(
    job: Job, batch: Batch, where: str = "data.path"
) -> tuple[tuple[tuple[Tensor, ...], Tensor], int]:
    """The batch's examples whose loss is finite, and how many were left out: a NaN example has
    no error to measure, and would make every engine's look like NaN."""
    inputs, targets = job.to_device(batch)
    with torch.no_grad():  # the engine's losses: an error in the forward is one line
        keep = torch.isfinite(job.engine.losses(inputs, targets))
    if not keep.any():
        raise DataError("every checked example has a NaN or infinite loss", where)
    return (tuple(t[keep] for t in inputs), targets[keep]), int((~keep).sum())
