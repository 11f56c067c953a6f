"""The gradient index: ``index`` writes it, ``query`` scores references against it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import terminal
from ..config import load_config, with_overrides
from .options import (
    BatchOpt,
    ConfigArg,
    DeviceOpt,
    LimitOpt,
    ResumeOpt,
    TrustOpt,
    precondition_option,
    ref_option,
)
from .scoring import note_weights, scored


def index(
    config: ConfigArg,
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            metavar="DIR",
            help="Index folder to write (default: output.path as NAME.index).",
        ),
    ] = None,
    dim: Annotated[
        int | None,
        typer.Option(
            "--dim", metavar="K", help="Numbers kept per parameter, k_out * k_in (default 1024)."
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="S", help="Seed of the random projections.")
    ] = 0,
    storage: Annotated[
        str,
        typer.Option(
            "--storage", metavar="float16|float32", help="float16 or float32 rows on disk."
        ),
    ] = "float16",
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    limit: LimitOpt = None,
    resume: ResumeOpt = False,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Write each example's projected gradient to an index folder, to query many times."""
    from ..index.layout import described
    from ..index.scorer import IndexScorer, index_output

    cfg = with_overrides(load_config(config), device=device, batch_size=batch_size, limit=limit)
    path = scored(index_output(cfg, out), IndexScorer(dim, seed, storage), trust_checkpoint, resume)
    if path is not None:  # rank 0 under torchrun
        terminal.console.print(described(path))
        terminal.wrote(path)
        note_weights(cfg)


QueryPerRefOpt = Annotated[
    bool, typer.Option("--per-ref", help="Every REF row its own reference: its top-k.")
]
QueryTopKOpt = Annotated[
    int | None,
    typer.Option(
        "--top-k",
        metavar="K",
        help="Rows per reference (default: every example for the "
        "mean reference, else summary.top_k).",
    ),
]  # fmt: skip
ExactOpt = Annotated[
    bool,
    typer.Option(
        "--exact",
        help="Re-score each reference's top k * M candidates with the "
        "exact engine and rank by the exact scores.",
    ),
]  # fmt: skip
CandidatesOpt = Annotated[
    int | None,
    typer.Option(
        "--candidates", metavar="M", help="M of --exact: candidates per top-k row (default 30)."
    ),
]
NormalizeOpt = Annotated[
    bool, typer.Option("--normalize", help="Cosine: unit-normalised gradients.")
]
QueryOutOpt = Annotated[
    str | None,
    typer.Option(
        "--out", metavar="PATH", help="Parquet file to write (default: INDEX.query.parquet)."
    ),
]
QueryConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="CONFIG",
        help="The config the index was built with (needed: a query runs no code an index names).",
    ),
]


def query(
    index: Annotated[
        Path, typer.Argument(metavar="INDEX", help="An index folder written by gradscope index.")
    ],
    ref: ref_option("Reference data (any format data.path takes); same columns."),
    per_ref: QueryPerRefOpt = False,
    top_k: QueryTopKOpt = None,
    exact: ExactOpt = False,
    candidates: CandidatesOpt = None,
    normalize: NormalizeOpt = False,
    precondition: precondition_option("applied to the references.") = None,
    out: QueryOutOpt = None,
    config: QueryConfigOpt = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Score every indexed example against the gradients of REF (their mean, or each row)."""
    from ..index.query import Query, run_query, shown

    asked = Query(
        ref if ".py:" in ref else str(Path(ref).resolve()), per_ref, top_k, exact,
        candidates, normalize,
        str(precondition.resolve()) if precondition else None,
    )  # fmt: skip
    path = run_query(
        index, asked, out, config=config, device=device, batch_size=batch_size,
        trust_checkpoint=trust_checkpoint,
    )  # fmt: skip
    terminal.console.print(shown(path))
    terminal.wrote(path)
