"""Curvature-aware scores: K-FAC / EK-FAC factors from the engine's captured inputs and output
gradients (``gradscope factors``), and the preconditioners ``--precondition`` applies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from .. import distributed
from ..config import Config
from ..engine import Engine
from .factors import DIAGONAL, EKFAC, KFAC, Block, damping, factored_convs, fit
from .fisher import SampledLoss, check_fisher
from .made import weights_sha256
from .precondition import Curvature, Diagonal, Preconditioner, load_preconditioner
from .store import Factors, is_factors_file, metadata

__all__ = [
    "Curvature",
    "Diagonal",
    "Factors",
    "Preconditioner",
    "fit_factors",
    "is_factors_file",
    "load_preconditioner",
]


def fit_factors(
    cfg: Config,
    out: str | Path,
    *,
    ekfac: bool = False,
    fisher: str = "true",
    trust_checkpoint: bool = False,
    on_start: Callable[[int | None], None] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Factors:
    """Compute the configured model's factors over its data (``compute_factors``) and write
    them to ``out``."""
    from ..inputs import check_output, run_inputs
    from ..io.data import open_dataset
    from ..job import Job

    distributed.one_process("gradscope factors", "factors")
    check_fisher(fisher, cfg.loss.name)
    check_output(out, run_inputs(cfg), "factors")
    job = Job.from_config(cfg, trust_checkpoint)
    if on_start:
        total = open_dataset(cfg.data).length
        if total is not None and cfg.data.limit is not None:
            total = min(total, cfg.data.limit)
        on_start(None if total is None else total * (2 if ekfac else 1))
    factors = compute_factors(job, ekfac=ekfac, fisher=fisher, on_batch=on_batch)
    factors.save(out)
    return factors


def compute_factors(
    job,
    *,
    ekfac: bool = False,
    fisher: str = "true",
    on_batch: Callable[[int], None] | None = None,
) -> Factors:
    """The job's model's factors over its data (``data.limit`` rows). The true Fisher draws each
    batch's targets from the model (seeded by the batch's position, so a run is reproducible);
    the empirical Fisher uses the data's targets."""
    from ..io.data import open_dataset
    from ..job import config_loss

    cfg = job.cfg
    loss, forward = config_loss(cfg), job.engine.forward
    sampled = None
    if fisher == "true":
        sampled = SampledLoss(
            cfg.loss.name,
            loss,
            cfg.loss.kwargs,
            cfg.loss.class_dim,
            token_reduction=cfg.loss.token_reduction,
        )
    engine = Engine(
        job.model, sampled.scaled if sampled else loss, cfg.params.include, cfg.params.exclude,
        forward,
    )  # fmt: skip
    dataset = open_dataset(cfg.data)

    def batches():
        for batch in dataset.batches(cfg.data.batch_size, cfg.data.limit):
            yield job.to_device(batch)

    def draw(seed: int, inputs: tuple, targets: Tensor) -> Tensor:
        """The true Fisher's labels for a batch, from a forward of their own (eval mode)."""
        args, kwargs = forward.split(inputs)
        with torch.no_grad():
            output = forward.select(job.model(*args, **kwargs))
        sampled.seed = seed
        return sampled.sample(output, targets)

    with engine, factored_convs():
        blocks, examples, left_out = fit(
            engine.contributions,
            batches,
            ekfac=ekfac,
            draw=draw if sampled else None,
            on_batch=on_batch,
        )
    _unreached(engine, blocks)
    model = job.metadata("factors") | {
        "plan": engine.plan.describe(),
        "weights_sha256": weights_sha256(engine.plan),
    }
    meta = metadata(EKFAC if ekfac else KFAC, fisher, examples, model) | {"left_out": left_out}
    return Factors(blocks, meta)


def _unreached(engine: Engine, blocks: dict[str, Block]) -> None:
    """A zero diagonal block for each parameter no row's gradient reached: its curvature is
    zero, damped as ``factors.damping`` damps zeros; every gradient of it on these rows scores 0."""
    for p in engine.plan.included:
        if p.name not in blocks:
            zero = torch.zeros(p.param.shape, dtype=torch.float64)
            damped = {"diagonal": damping(zero)}
            blocks[p.name] = Block(DIAGONAL, p.param.shape, {"diagonal": zero}, damped)
