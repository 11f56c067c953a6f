"""The ``validate`` command: score files measured against retraining (LDS, the removal test,
detection AUROC), the table printed and written."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .. import terminal
from ..config import load_config, output_path
from .options import ConfigArg, ref_option

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import RenderableType

ScoresOpt = Annotated[
    list[Path],
    typer.Option(
        "--scores",
        metavar="S.parquet",
        help="Score files to validate: influence (--per-ref or not) or norms files.",
    ),
]
MoreArg = Annotated[
    list[Path] | None,
    typer.Argument(
        metavar="S2.parquet ...", help="More score files, after --scores.", show_default=False
    ),
]
SubsetsOpt = Annotated[
    int | None,
    typer.Option("--subsets", metavar="M", help="Random subsets retrained (default 100)."),
]
FractionOpt = Annotated[
    float | None,
    typer.Option(
        "--fraction", metavar="A", help="Share of the rows in each subset, in (0, 1) (default 0.5)."
    ),
]
SeedsOpt = Annotated[
    int | None,
    typer.Option("--seeds", metavar="S", help="Seeds each subset is trained under (default 1)."),
]
TargetOpt = Annotated[
    str,
    typer.Option("--target", metavar="loss|margin", help="What the scores predict per reference."),
]
RemovalOpt = Annotated[
    int | None,
    typer.Option(
        "--removal",
        metavar="K",
        help="Removal test: retrain without each "
        "reference's top K rows, and without K random rows.",
    ),
]
RemovalRefsOpt = Annotated[
    int, typer.Option("--removal-refs", metavar="N", help="References the removal test runs on.")
]
BadOpt = Annotated[
    str | None,
    typer.Option(
        "--bad",
        metavar="COLUMN",
        help="Data column marking known-bad rows: "
        "detection AUROC of every column that ranks examples.",
    ),
]
ColumnOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--column", metavar="NAME", help="Score column to validate (repeatable; default influence)."
    ),
]
TruthOpt = Annotated[
    str | None,
    typer.Option(
        "--truth",
        metavar="TRUTH.parquet",
        help="Ground-truth file: reused when it exists, else written (default: OUT.truth.parquet).",
    ),
]
SameOrderOpt = Annotated[
    bool,
    typer.Option(
        "--same-order",
        help="Retrain each subset in the full run's batches and order, its left-out rows "
        "weighted 0 (the setting through-training scores predict), not alone.",
    ),
]
JobsOpt = Annotated[
    int, typer.Option("--jobs", metavar="N", help="Processes that retrain side by side.")
]
ResumeOpt = Annotated[
    bool,
    typer.Option("--resume", help="Continue an interrupted run with the same config, data and "
                 "models to train, keeping the models it trained."),
]  # fmt: skip
OutOpt = Annotated[
    str, typer.Option("--out", metavar="PATH", help="Table to write, Parquet (and .json beside).")
]


def validate(
    config: ConfigArg,
    ref: ref_option("Reference data the score files were computed against."),
    scores: ScoresOpt,
    more: MoreArg = None,
    subsets: SubsetsOpt = None,
    fraction: FractionOpt = None,
    seeds: SeedsOpt = None,
    target: TargetOpt = "loss",
    removal: RemovalOpt = None,
    removal_refs: RemovalRefsOpt = 10,
    bad: BadOpt = None,
    column: ColumnOpt = None,
    truth: TruthOpt = None,
    same_order: SameOrderOpt = False,
    jobs: JobsOpt = 1,
    resume: ResumeOpt = False,
    out: OutOpt = "validation.parquet",
) -> None:
    """Measure score files against retraining: LDS, the removal test, detection AUROC."""
    from ..io.parquet import read_metadata
    from ..validation import Options
    from ..validation import validate as run

    cfg = load_config(config)
    options = Options(
        subsets=subsets, fraction=fraction, seeds=seeds, target=target, removal=removal,
        removal_refs=removal_refs, bad=bad, columns=tuple(column or ()), jobs=jobs, resume=resume,
        same_order=same_order,
    )  # fmt: skip
    out_path = Path(output_path(out, Path.cwd(), "--out"))
    truth_path = Path(output_path(truth, Path.cwd(), "--truth")) if truth else None
    with terminal.progress("validate", "models") as (on_start, on_model):
        table = run(cfg, ref, [*scores, *(more or [])], options=options, out=out_path,
                    truth=truth_path, on_start=on_start, on_model=on_model)  # fmt: skip
    if table is not None:
        terminal.console.print(render(table, read_metadata(out_path)["design"]))
        terminal.wrote(out_path)


def render(table: pd.DataFrame, design: dict) -> RenderableType:
    """The table as the terminal shows it: one row per (file, column), file names short."""
    from rich.console import Group
    from rich.text import Text

    from ..tables import FittedTable, fmt

    cells = {name: [_cell(name, v, fmt) for v in table[name]] for name in table.columns}
    cells["file"] = [Path(f).name for f in table["file"]]
    caption = (
        f"lds: Spearman over {design['subsets']} subsets of {design['size']} rows, "
        f"{design['seeds']} seed(s) each, averaged over references; lds_low, lds_high: "
        "95% bootstrap interval of the mean"
    )
    chance = 2 / math.factorial(design["subsets"])  # a random ranking's, of either sign
    if chance > 1e-3:  # the references share the subsets: the interval cannot show it
        caption += (
            f". Over {design['subsets']} subsets a score of no merit reaches an lds of +-1 "
            f"with probability {chance:.2g}, and the interval resamples references, not "
            "subsets: use more (--subsets)"
        )
    # under the table, not its caption: a caption as wide as the table would widen its columns
    return Group(FittedTable(cells, title="validation", keep=2), Text(caption))


def _cell(name: str, value: object, fmt) -> str:
    import pandas as pd

    if value is None or pd.isna(value):  # not measured for this column
        return "-"
    if name == "references":
        return str(int(value))
    return fmt(value)
