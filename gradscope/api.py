"""What notebooks and the CLI call: per-example norms of a batch, or of a whole configured dataset."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from . import __version__, distributed
from .config import Config
from .engine.check import CheckReport, compare_with_loop
from .engine.core import Engine, total
from .engine.forward import Forward
from .engine.influence import (
    MAX_PER_REF,
    Influence,
    adam_denominator,
    check_engine,
    influence_errors,
    reference_gradients,
)
from .engine.plan import Plan
from .errors import ConfigError, DataError, Interrupted
from .io.data import Batch, data_sha256, open_dataset
from .io.model import build_model, file_sha256, import_object, load_state_dict
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
    engine = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with engine:
        scores = engine.norms(_as_tuple(inputs), targets)
    return total(scores.norm_sq).sqrt()


def per_example_influence(
    model: nn.Module,
    inputs: Tensor | Sequence[Tensor],
    targets: Tensor,
    ref_inputs: Tensor | Sequence[Tensor],
    ref_targets: Tensor,
    loss: str | LossFn = "cross_entropy",
    *,
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    output: str | int | None = None,
    precondition: dict | None = None,
    engine: str = "auto",
) -> Tensor:
    """(B,) float64 ``<grad l_i, g_ref>``, g_ref the gradient of the MEAN loss over the reference.

    Positive: a gradient step on example i lowers the reference loss. ``precondition`` is an
    ``Adam``/``AdamW`` ``state_dict()`` of this model's optimizer; scores then use
    ``g_ref / (sqrt(v_hat) + eps)``. ``engine`` is ``hooks``, ``jvp`` (forward mode, no backward)
    or ``auto`` (jvp, moving to hooks if an op lacks forward mode). ``.grad`` fields, hooks and
    train/eval mode are left as they were.
    """
    core = Engine(
        model, resolve_loss(loss), include, exclude, Forward(output=output, where="output=")
    )
    with core:
        refs = reference_gradients(core, [(_as_tuple(ref_inputs), ref_targets)])
        if precondition is not None:
            refs = _preconditioned(refs, adam_denominator(precondition, core, "precondition"))
        scores = Influence(core, refs, engine, norms=False)(_as_tuple(inputs), targets)
    return scores.inner[:, 0]


def _preconditioned(refs: dict[str, Tensor], denominators: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: r / denominators[name] for name, r in refs.items()}  # (K, *shape) / (*shape)


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
    engine: Engine
    extra: dict = field(default_factory=dict)  # more metadata from the scorer, by command

    @classmethod
    def from_config(cls, cfg: Config, trust_checkpoint: bool = False) -> Job:
        """Build the model at ``model.checkpoint``, or at the last of ``model.checkpoints``."""
        device = resolve_device(cfg.device)
        model_cfg = cfg.model
        if model_cfg.checkpoints:
            model_cfg = dataclasses.replace(model_cfg, checkpoint=model_cfg.checkpoints[-1].path)
        model = build_model(model_cfg, trust_checkpoint)
        dtype = getattr(torch, cfg.dtype) if cfg.dtype else next(model.parameters()).dtype
        model.to(device=device, dtype=dtype)
        inputs = cfg.data.inputs  # a mapping {forward_argument: column} is passed by keyword
        keywords = tuple(inputs) if isinstance(inputs, dict) else ()
        engine = Engine(
            model,
            config_loss(cfg),
            cfg.params.include,
            cfg.params.exclude,
            Forward(keywords=keywords, output=cfg.model.output),
        )
        return cls(cfg, model, device, dtype, engine)

    @property
    def plan(self) -> Plan:
        return self.engine.plan

    def to_device(self, batch: Batch) -> tuple[tuple[Tensor, ...], Tensor]:
        def move(t: Tensor) -> Tensor:
            return t.to(self.device, self.dtype if t.is_floating_point() else None)

        return tuple(move(t) for t in batch.inputs), batch.targets.to(self.device)

    def at_checkpoint(self, path: str, trust_checkpoint: bool = False) -> Job:
        """The same job with the model's weights from ``path``: one step of a TracIn sum."""
        model = dataclasses.replace(self.cfg.model, checkpoint=path, checkpoints=[])
        return Job.from_config(dataclasses.replace(self.cfg, model=model), trust_checkpoint)

    def metadata(self, command: str) -> dict:
        ckpt = self.cfg.model.checkpoint or (
            self.cfg.model.checkpoints[-1].path if self.cfg.model.checkpoints else None
        )
        return {
            "version": __version__,
            "command": command,
            "config": self.cfg.to_dict(),
            "torch": torch.__version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "checkpoint_sha256": file_sha256(ckpt) if ckpt else None,
            "plan": self.plan.describe(),
            **self.extra,
        }


def norms_columns(job: Job, batch: Batch) -> dict[str, np.ndarray]:
    """One batch's rows: example_id, id, loss, grad_norm, grad_norm/<module>, target, finite."""
    scores = job.engine.norms(*job.to_device(batch))
    norm_sq = total(scores.norm_sq)
    columns: dict[str, np.ndarray] = {"example_id": batch.index.numpy()}
    if batch.ids is not None:
        columns["id"] = batch.ids
    loss = scores.loss.double().cpu()
    columns["loss"] = loss.numpy()
    columns["grad_norm"] = norm_sq.sqrt().cpu().numpy()
    if job.cfg.output.per_layer:
        per_module: dict[str, Tensor] = {}
        for p in job.plan.included:
            per_module[p.module] = per_module.get(p.module, 0) + scores.norm_sq[p.name].double()
        for module in job.plan.modules:
            columns[f"grad_norm/{module}"] = per_module[module].sqrt().cpu().numpy()
    if batch.targets.dim() == 1:
        columns["target"] = batch.targets.numpy()
    columns["finite"] = (torch.isfinite(loss) & torch.isfinite(norm_sq.cpu())).numpy()
    return columns


def _file_hash(path: str | Path | None) -> str | None:
    """sha256 of a file that exists; a missing one is reported by the code that reads it."""
    return file_sha256(path) if path and Path(path).is_file() else None


def _fingerprint(cfg: Config, command: str, resume_key: dict | None) -> dict:
    """What a partial run must share with the run that resumes it, as JSON reads it back."""
    config = cfg.to_dict()
    for key in ("summary", "source", "device"):  # display, file name, placement (ranks differ)
        config.pop(key)
    checkpoints = [cfg.model.checkpoint] if cfg.model.checkpoint else []
    checkpoints += [c.path for c in cfg.model.checkpoints]
    fingerprint = {
        "command": command,
        "config": config,
        "checkpoint_sha256": [_file_hash(c) for c in checkpoints],
        **(resume_key or {}),
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
    resume_key: dict | None = None,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path | None:
    """Score every example of ``cfg``'s dataset with ``score_batch`` and write the Parquet file.

    Each batch's rows become a part file in the partial folder as soon as they are scored (see
    ``io/parquet.py``); with ``resume`` the parts of an interrupted run with the same command,
    config and checkpoint are kept and only the missing batches are scored. Under torchrun, rank r
    scores batches r, r + K, ... and rank 0 assembles the file; other ranks return None.
    The first batch runs before anything is written, so input the model cannot take leaves no file.
    ``resume_key`` adds what else a resumed run must share (the scorer's inputs, e.g. REF's hash).
    A scorer with a ``setup(job)`` method has it called once on every rank before the first batch
    (where ranks may exchange tensors). ``on_start`` gets the number of rows this process scores,
    None when unknown before reading.
    """
    with distributed.session() as world:
        job = Job.from_config(
            dataclasses.replace(cfg, device=world.device(cfg.device)), trust_checkpoint
        )
        dataset = open_dataset(cfg.data)
        run = PartialRun(cfg.output.path)
        fingerprint = _fingerprint(cfg, command, resume_key)
        saved = run.manifest() if resume else None
        if saved is not None and saved["fingerprint"] != fingerprint:
            keys = _differences(saved["fingerprint"], fingerprint)
            raise ConfigError(
                f"cannot resume: the interrupted run had a different {', '.join(keys)}; "
                "run without --resume to start over",
                str(run.dir),
            )
        done = run.done() if saved is not None else set()
        length = dataset.length
        if length is not None and cfg.data.limit is not None:
            length = min(length, cfg.data.limit)
        if on_start:
            on_start(world.rows(length, cfg.data.batch_size))

        def start() -> None:
            """Once every rank's first batch has run: begin the partial folder, or keep it."""
            distributed.barrier()
            if world.main and saved is None:
                run.start({"fingerprint": fingerprint, "metadata": job.metadata(command)})
            distributed.barrier()

        started, rows, number = False, 0, -1
        with job.engine:
            if hasattr(score_batch, "setup"):
                score_batch.setup(job)
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


class InfluenceColumns:
    """The ``influence`` command's scorer: ``<grad l_i, g_ref>`` at each checkpoint, weighted and
    summed (TracIn), with loss, grad_norm and cosine; one row per (example, reference example)
    pair with ``per_ref``.

    Use it as a context manager: the models it builds for earlier checkpoints stay prepared
    (eval mode, gradients on) until exit. The references are computed at the first batch.
    """

    def __init__(
        self,
        ref: str | Path,
        *,
        per_ref: bool = False,
        precondition: str | Path | None = None,
        engine: str = "auto",
        trust_checkpoint: bool = False,
    ):
        if precondition is not None and not Path(precondition).is_file():
            raise ConfigError("optimizer state file not found", str(precondition))
        ref = str(ref)  # a path relative to the working directory, or file.py:make_dataset
        self.ref = ref if ".py:" in ref else str(Path(ref).resolve())
        self.per_ref, self.precondition = per_ref, precondition
        self.engine, self.trust_checkpoint = check_engine(engine), trust_checkpoint
        self._stack = contextlib.ExitStack()
        self._scorers: list[Influence] = []
        self._weights: Tensor | None = None  # (C,) one per checkpoint
        self._ref_sq: Tensor | None = None  # (K,) sum_c w_c ||r_ck||^2

    def __enter__(self) -> InfluenceColumns:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def setup(self, job: Job) -> None:
        """Read REF and compute the reference gradients (under torchrun: on rank 0, then shared)."""
        cfg = job.cfg
        # REF is read with the same input and target names; its rows need no ids
        ref_data = open_dataset(dataclasses.replace(cfg.data, ids=None, limit=None), self.ref)
        if self.per_ref and len(ref_data) > MAX_PER_REF:
            raise DataError(
                f"--per-ref writes one row per (example, reference) pair and takes at most "
                f"{MAX_PER_REF} reference examples; REF has {len(ref_data)}",
                self.ref,
            )
        state = load_state_dict(self.precondition) if self.precondition else None
        checkpoints = cfg.model.checkpoints
        jobs = [job.at_checkpoint(c.path, self.trust_checkpoint) for c in checkpoints[:-1]]
        for other in jobs:
            self._stack.enter_context(other.engine)
        jobs.append(job)  # the job's own model is at the last checkpoint
        weights = [c.weight for c in checkpoints] or [1.0]
        described = []
        for n, (j, w) in enumerate(zip(jobs, weights, strict=True)):
            batches = (j.to_device(b) for b in ref_data.batches(cfg.data.batch_size))
            main = distributed.world().main
            refs = reference_gradients(j.engine, batches, self.per_ref) if main else None
            refs = distributed.broadcast_tensors(refs, j.device)
            if state is not None:
                refs = _preconditioned(
                    refs, adam_denominator(state, j.engine, str(self.precondition))
                )
            scorer = Influence(j.engine, refs, self.engine, norms=True)
            self._scorers.append(scorer)
            described.append(
                {
                    "index": n,
                    "path": checkpoints[n].path if checkpoints else cfg.model.checkpoint,
                    "weight": w,
                    "ref_grad_norm": None if self.per_ref else scorer.ref_norm.item(),
                }
            )
        self._weights = torch.tensor(weights, dtype=torch.float64)
        self._ref_sq = sum(
            w * s.ref_norm.pow(2) for w, s in zip(weights, self._scorers, strict=True)
        ).cpu()
        job.extra["influence"] = {
            "ref": self.ref,
            "ref_sha256": data_sha256(self.ref),  # REF may be a folder or a glob
            "ref_examples": len(ref_data),
            "per_ref": self.per_ref,
            "precondition": None
            if state is None
            else {"path": str(self.precondition), "sha256": file_sha256(self.precondition)},
            "engine": self.engine,
            "checkpoints": described,
        }

    def __call__(self, job: Job, batch: Batch) -> dict[str, np.ndarray]:
        if not self._scorers:
            self.setup(job)
        inputs, targets = job.to_device(batch)
        results = [s(inputs, targets) for s in self._scorers]
        job.extra["influence"]["engines_used"] = [s.method for s in self._scorers]
        job.extra["influence"]["notes"] = [s.note for s in self._scorers if s.note]
        w = self._weights
        influence = sum(wc * r.inner.cpu() for wc, r in zip(w, results, strict=True))  # (B, K)
        norm_sq = sum(wc * r.norm_sq.cpu() for wc, r in zip(w, results, strict=True))  # (B,)
        # cosine in the space of all checkpoints' gradients each scaled by sqrt(weight)
        cosine = influence / (norm_sq[:, None] * self._ref_sq[None]).sqrt()
        b, k = influence.shape
        last = results[-1]
        loss, grad_norm = last.loss.cpu(), last.norm_sq.cpu().sqrt()

        def rows(values: Tensor | np.ndarray) -> np.ndarray:  # one per (example, ref) pair
            array = values.numpy() if isinstance(values, Tensor) else values
            return np.repeat(array, k, axis=0)

        columns: dict[str, np.ndarray] = {"example_id": rows(batch.index)}
        if batch.ids is not None:
            columns["id"] = rows(batch.ids)
        if self.per_ref:
            columns["ref_id"] = np.tile(np.arange(k, dtype=np.int64), b)
        columns["loss"], columns["grad_norm"] = rows(loss), rows(grad_norm)
        if len(results) > 1:
            for n, r in enumerate(results):
                columns[f"loss@{n}"] = rows(r.loss.cpu())
                columns[f"grad_norm@{n}"] = rows(r.norm_sq.cpu().sqrt())
        columns["influence"], columns["cosine"] = (
            influence.flatten().numpy(),
            cosine.flatten().numpy(),
        )
        if batch.targets.dim() == 1:
            columns["target"] = rows(batch.targets)
        finite = torch.stack(
            [torch.isfinite(r.loss.cpu()) & torch.isfinite(r.norm_sq.cpu()) for r in results]
        ).all(0)
        columns["finite"] = (finite[:, None] & torch.isfinite(influence)).flatten().numpy()
        return columns


def influence_dataset(
    cfg: Config,
    ref: str | Path,
    *,
    per_ref: bool = False,
    precondition: str | Path | None = None,
    engine: str = "auto",
    trust_checkpoint: bool = False,
    resume: bool = False,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Path | None:
    """Score ``cfg``'s dataset against the reference data file ``ref`` and write the Parquet file."""
    scorer = InfluenceColumns(
        ref,
        per_ref=per_ref,
        precondition=precondition,
        engine=engine,
        trust_checkpoint=trust_checkpoint,
    )
    with scorer:
        return score_dataset(
            cfg,
            "influence",
            scorer,
            trust_checkpoint=trust_checkpoint,
            resume=resume,
            resume_key={
                "ref_sha256": data_sha256(scorer.ref),
                "per_ref": per_ref,
                "precondition_sha256": _file_hash(precondition),
                "engine": scorer.engine,
            },
            on_start=on_start,
            on_batch=on_batch,
        )


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
    batch = job.to_device(next(open_dataset(cfg.data).batches(examples, examples)))
    reference = batch
    if ref is not None:
        reference = job.to_device(next(open_dataset(cfg.data, ref).batches(examples, examples)))
    with job.engine:
        report = compare_with_loop(job.engine, *batch)
    report.influence = influence_errors(job.engine, *batch, *reference)
    return report
