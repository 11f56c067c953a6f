"""``gradscope train``: the config's recipe run once, its checkpoint written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .. import terminal
from ..config import load_config, with_overrides
from .options import ConfigArg, DeviceOpt

TrainOutOpt = Annotated[
    str | None,
    typer.Option("--out", metavar="PATH", help="Checkpoint to write (default: model.checkpoint)."),
]
TrainResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume", help="Continue an interrupted run of the same config from its last epoch."
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace a checkpoint that is there already, or an interrupted run's saved state.",
    ),
]
RecordOpt = Annotated[
    bool,
    typer.Option(
        "--record",
        help="Also write the run record NAME.run/ beside the checkpoint, for influence "
        "--through-training.",
    ),
]
SegmentOpt = Annotated[
    int | None,
    typer.Option(
        "--segment",
        metavar="K",
        help="With --record: a checkpoint every K steps (default sqrt(steps)).",
    ),
]


def train(
    config: ConfigArg,
    out: TrainOutOpt = None,
    device: DeviceOpt = None,
    resume: TrainResumeOpt = False,
    overwrite: OverwriteOpt = False,
    record: RecordOpt = False,
    segment: SegmentOpt = None,
) -> None:
    """Train the model by the config's train: recipe and write its checkpoint."""
    from ..training.run import train_model

    cfg = with_overrides(load_config(config), device=device)
    with terminal.progress("train") as (on_start, on_batch):
        trained = train_model(cfg, out, resume=resume, overwrite=overwrite, record=record,
                              segment=segment, on_start=on_start, on_batch=on_batch)  # fmt: skip
    if trained.steps:
        terminal.console.print(
            f"{trained.rows} rows, {trained.steps} steps; mean training loss of the last "
            f"epoch {trained.loss:.4g}"
        )
    for path, _ in trained.epochs[:-1]:
        terminal.wrote(path)
    terminal.wrote(trained.path)
    if trained.record:
        terminal.wrote(trained.record)
    if trained.epochs:  # influence's sum over checkpoints, each weighted by its learning rate
        base = Path(config).resolve().parent  # the list's paths: relative to the config's
        listed = ", ".join(
            f"{{path: {os.path.relpath(Path(p).resolve(), base)}, weight: {lr:.4g}}}"
            for p, lr in trained.epochs
        )
        terminal.console.print(
            f"for an ensemble (TracIn with --curvature none): model.checkpoints: [{listed}]",
            soft_wrap=True,
            highlight=False,
        )
