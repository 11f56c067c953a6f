"""The gradscope command line: thin commands over the library, and the one error boundary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from typer.core import TyperGroup

from .config import load_config, with_overrides
from .errors import GradscopeError


class _ErrorBoundary(TyperGroup):
    """The one place errors become exit codes: a user-fixable error is one line and status 2."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except GradscopeError as e:
            if os.environ.get("GRADSCOPE_DEBUG"):
                raise
            Console(stderr=True).print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_ErrorBoundary,
    add_completion=False,
    no_args_is_help=True,
    help="Per-example gradient diagnostics for PyTorch models. GRADSCOPE_DEBUG=1 shows tracebacks.",
)
console = Console()

ConfigArg = Annotated[
    Path, typer.Argument(help="YAML config naming the model, checkpoint and data.")
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", help="Parquet file to write (default: output.path).")
]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")]
BatchOpt = Annotated[int | None, typer.Option("--batch-size", help="Examples per pass.")]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="Score only the first N examples.")]
TopKOpt = Annotated[int | None, typer.Option("--top-k", help="Rows in the outlier table.")]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-checkpoint",
        help="Load a checkpoint that weights_only=True refuses (runs its pickle).",
    ),
]


def _progress() -> Progress:
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def _report(path: Path, by: str | None, top_k: int) -> None:
    from .summary import render

    console.print(render(pd.read_parquet(path), by, top_k))
    console.print(f"wrote {path}")


@app.command()
def norms(
    config: ConfigArg,
    out: OutOpt = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    limit: LimitOpt = None,
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="Add a grad_norm/<module> column per module.")
    ] = False,
    top_k: TopKOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """L2 norm of each example's own loss gradient."""
    from .api import score_dataset

    cfg = with_overrides(
        load_config(config),
        out=out,
        device=device,
        batch_size=batch_size,
        limit=limit,
        per_layer=per_layer,
        top_k=top_k,
    )
    with _progress() as progress:
        task = progress.add_task("norms", total=None)
        path = score_dataset(
            cfg,
            "norms",
            trust_checkpoint=trust_checkpoint,
            on_start=lambda n: progress.update(task, total=n),
            on_batch=lambda n: progress.advance(task, n),
        )
    _report(path, "grad_norm", cfg.summary.top_k)


@app.command()
def influence(
    config: ConfigArg,
    ref: Annotated[
        str,
        typer.Option(
            "--ref", help="Reference data file (any format data.path takes); same column names."
        ),
    ],
    out: OutOpt = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    limit: LimitOpt = None,
    top_k: TopKOpt = None,
    per_ref: Annotated[
        bool,
        typer.Option("--per-ref", help="One row per (example, reference example) pair, ref_id."),
    ] = False,
    precondition: Annotated[
        Path | None,
        typer.Option(
            "--precondition",
            help="Adam/AdamW state_dict: score against g_ref / (sqrt(v_hat) + eps).",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option("--engine", help="auto, hooks (ghost inner products) or jvp (forward mode)."),
    ] = "auto",
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Inner product of each example's loss gradient with the mean-loss gradient over REF."""
    from .api import influence_dataset

    cfg = with_overrides(
        load_config(config),
        out=out,
        device=device,
        batch_size=batch_size,
        limit=limit,
        top_k=top_k,
    )
    with _progress() as progress:
        task = progress.add_task("influence", total=None)
        path = influence_dataset(
            cfg,
            ref,
            per_ref=per_ref,
            precondition=precondition,
            engine=engine,
            trust_checkpoint=trust_checkpoint,
            on_start=lambda n: progress.update(task, total=n),
            on_batch=lambda n: progress.advance(task, n),
        )
    _report(path, "influence", cfg.summary.top_k)


@app.command()
def check(
    config: ConfigArg,
    examples: Annotated[
        int, typer.Option("--examples", help="Compare on the first N examples.")
    ] = 8,
    device: DeviceOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Compare the fast engine with a per-example backward loop; exit 1 above tolerance."""
    from .api import check_config
    from .engine.check import render_plan, render_report

    cfg = with_overrides(load_config(config), device=device)
    report = check_config(cfg, examples, trust_checkpoint=trust_checkpoint)
    console.print(render_plan(report.plan))
    console.print(render_report(report))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def summary(
    scores: Annotated[Path, typer.Argument(help="A Parquet file written by gradscope.")],
    by: Annotated[
        str | None,
        typer.Option("--by", help="Column to rank by (default: influence, else grad_norm)."),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="Rows in the outlier table.")] = 20,
) -> None:
    """Print the outlier tables of an existing scores file."""
    from .errors import DataError

    if not scores.is_file():
        raise DataError("scores file not found", str(scores))
    _report(scores, by, top_k)


def main() -> None:
    app()
