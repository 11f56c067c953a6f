"""The arguments and options the commands share, as typer reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

ConfigArg = Annotated[
    Path,
    typer.Argument(metavar="CONFIG", help="YAML config naming the model, checkpoint and data."),
]
OutOpt = Annotated[  # a string: a trailing '/' (a folder) must reach the check
    str | None,
    typer.Option("--out", metavar="PATH", help="Parquet file to write (default: output.path)."),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", metavar="DEV", help="auto, cpu, cuda, cuda:N or mps (default: device)."
    ),
]
BatchOpt = Annotated[
    int | None,
    typer.Option("--batch-size", metavar="N", help="Examples per pass (default: data.batch_size)."),
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", metavar="N", help="Score only the first N examples.")
]
TopKOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k", metavar="K", help="Rows per outlier table (default: summary.top_k, else 20)."
    ),
]
ByOpt = Annotated[
    str | None,
    typer.Option(
        "--by",
        metavar="COLUMN[:low|high]",
        help="Column to rank by, :low most negative first, :high largest first (default: "
        "influence with both ends, else self_influence, else a query's exact score, else its "
        "score, else loss, else grad_norm).",
    ),
]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue an interrupted run with the same config and checkpoint, keeping its rows.",
    ),
]
ReportOpt = Annotated[
    bool, typer.Option("--report", help="Also write the HTML report beside the scores (.html).")
]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-checkpoint",
        help="Load a checkpoint that weights_only=True refuses (runs its pickle).",
    ),
]


ScoresArg = Annotated[
    Path, typer.Argument(metavar="SCORES", help="A Parquet file written by gradscope.")
]


def ref_option(what: str, required: bool = True) -> Any:
    """``--ref REF``, the reference data, as each command reads it: ``what`` it is for."""
    kind = str if required else Path | None
    return Annotated[kind, typer.Option("--ref", metavar="REF", help=what)]


def precondition_option(what: str) -> Any:
    """``--precondition FILE``: a factors file or an Adam/AdamW state dict, and ``what`` the
    command does with it."""
    return Annotated[
        Path | None,
        typer.Option(
            "--precondition",
            metavar="FILE",
            help=f"Factors file (gradscope factors) or Adam/AdamW state_dict: {what}",
        ),
    ]
