"""The gradscope command line: thin commands over the library, and the one error boundary."""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from typer.core import TyperGroup

from . import terminal
from .config import Config, SummaryConfig, load_config, output_path, with_overrides
from .errors import GradscopeError, Interrupted

if TYPE_CHECKING:  # the scorers import torch: not for --help, --version, summary
    from .scorers import Scorer

# transformers, when a config names it: no "Loading weights" bar, no advice on every run
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not os.environ.get("GRADSCOPE_DEBUG"):  # torch's C++ log lines (c10d's retries print stacks)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


LOGGED = ("norms", "influence", "factors", "check")  # commands that run a model over data


class _ErrorBoundary(TyperGroup):
    """The one place errors become exit codes: a user-fixable error is one line and status 2.
    Off a terminal, the commands that run a model log their start and their elapsed time."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["argv"] = list(args)  # the command line as given, for the log's first line
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context):
        argv = ctx.meta.get("argv", [])
        log = terminal.logged(argv) if argv[:1] and argv[0] in LOGGED else nullcontext()
        try:
            try:
                with warnings.catch_warnings(), log:
                    if not os.environ.get("GRADSCOPE_DEBUG"):  # torch's, libraries': none ours
                        warnings.simplefilter("ignore")
                    return super().invoke(ctx)
            except KeyboardInterrupt:  # before any example was saved (loading the model, REF)
                raise Interrupted(Interrupted.BEFORE_START) from None
        except GradscopeError as e:
            if os.environ.get("GRADSCOPE_DEBUG"):
                raise
            Console(stderr=True).print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None


app = typer.Typer(
    cls=_ErrorBoundary,
    no_args_is_help=True,
    rich_markup_mode=None,  # click's help: flags shown as flags, not as <bool>
)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        terminal.console.print(f"gradscope {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Per-example gradient diagnostics for PyTorch models. GRADSCOPE_DEBUG=1 shows tracebacks."""


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
        "influence with both ends, else self_influence with checkpoints, else grad_norm).",
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


def _run(
    cfg: Config, scorer: Scorer, by: str | None, report: bool, trust_checkpoint: bool, resume: bool
) -> None:
    """A scoring run under a progress bar, then the file it wrote, its outlier tables and, if
    asked, its report (on rank 0 only)."""
    from .run import score_dataset
    from .summary import check_by

    check_by(by, scorer.names(cfg))  # a bad --by fails before the run, not after it
    with terminal.progress(scorer.command) as (on_start, on_batch):
        path = score_dataset(
            cfg,
            scorer,
            trust_checkpoint=trust_checkpoint,
            resume=resume,
            on_start=on_start,
            on_batch=on_batch,
        )
    if path is None:  # on the ranks other than 0 under torchrun
        return
    try:
        try:
            _summary(path, by, cfg.summary.top_k, cfg.data.classes)
        finally:  # the scores are written whatever the tables make of them
            terminal.wrote(path)
        if report:
            _write_report(path, None, cfg, by, cfg.summary.top_k)
    except KeyboardInterrupt:  # the scores are whole: not "before any example was saved"
        raise Interrupted("interrupted after every example was saved", str(path)) from None


def _summary(path: Path, by: str | None, top_k: int, classes: list[str] | None = None) -> None:
    from .summary import summarize

    terminal.console.print(summarize(path, by, top_k, classes))


def _write_report(
    scores: Path, out: Path | None, cfg: Config | None, by: str | None, top_k: int
) -> None:
    from .report import write_report

    terminal.wrote(write_report(scores, out, cfg, by, top_k))


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
    by: ByOpt = None,
    precondition: Annotated[
        Path | None,
        typer.Option(
            "--precondition",
            metavar="FILE",
            help="Factors file (gradscope factors) or Adam/AdamW state_dict: adds "
            "self_influence = g^T P g, P the inverse curvature or 1 / (sqrt(v_hat) + eps).",
        ),
    ] = None,
    resume: ResumeOpt = False,
    trust_checkpoint: TrustOpt = False,
    report: ReportOpt = False,
) -> None:
    """L2 norm of each example's own loss gradient."""
    from .scorers import NormsScorer

    cfg = with_overrides(
        load_config(config),
        out=out,
        device=device,
        batch_size=batch_size,
        limit=limit,
        per_layer=per_layer,
        top_k=top_k,
    )
    _run(cfg, NormsScorer(trust_checkpoint, precondition), by, report, trust_checkpoint, resume)


@app.command()
def influence(
    config: ConfigArg,
    ref: Annotated[
        str,
        typer.Option(
            "--ref",
            metavar="REF",
            help="Reference data file (any format data.path takes); same column names.",
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
            metavar="FILE",
            help="Factors file (gradscope factors) or Adam/AdamW state_dict: score against "
            "P g_ref, P the inverse curvature or 1 / (sqrt(v_hat) + eps).",
        ),
    ] = None,
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="auto|hooks|jvp",
            help="auto, hooks (ghost inner products) or jvp (forward mode).",
        ),
    ] = "auto",
    by: ByOpt = None,
    resume: ResumeOpt = False,
    trust_checkpoint: TrustOpt = False,
    report: ReportOpt = False,
) -> None:
    """Inner product of each example's loss gradient with the mean-loss gradient over REF."""
    from .scorers import InfluenceScorer

    cfg = with_overrides(
        load_config(config),
        out=out,
        device=device,
        batch_size=batch_size,
        limit=limit,
        top_k=top_k,
    )
    scorer = InfluenceScorer(
        ref,
        per_ref=per_ref,
        precondition=precondition,
        engine=engine,
        trust_checkpoint=trust_checkpoint,
    )
    _run(cfg, scorer, by, report, trust_checkpoint, resume)


@app.command()
def check(
    config: ConfigArg,
    examples: Annotated[
        int, typer.Option("--examples", metavar="N", help="Compare on the first N examples.")
    ] = 8,
    ref: Annotated[
        Path | None,
        typer.Option(
            "--ref",
            metavar="REF",
            help="Reference data for the influence check (default: the examples).",
        ),
    ] = None,
    device: DeviceOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Compare both engines with a per-example backward loop; exit 1 above tolerance."""
    from .engine import render_plan, render_report
    from .job import check_config

    cfg = with_overrides(load_config(config), device=device)
    report = check_config(
        cfg, examples, ref=str(ref) if ref else None, trust_checkpoint=trust_checkpoint
    )
    terminal.console.print(render_plan(report.plan))
    if cfg.data.pad:
        terminal.console.print(_padding(cfg))
    terminal.console.print(render_report(report))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def factors(
    config: ConfigArg,
    out: Annotated[
        Path, typer.Option("--out", metavar="PATH", help="safetensors file to write.")
    ] = Path("factors.safetensors"),
    limit: LimitOpt = None,
    ekfac: Annotated[
        bool, typer.Option("--ekfac", help="A second pass for EK-FAC's corrected eigenvalues.")
    ] = False,
    fisher: Annotated[
        str,
        typer.Option(
            "--fisher",
            metavar="true|empirical",
            help="true (targets drawn from the model) or empirical (the data's).",
        ),
    ] = "true",
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """K-FAC (and EK-FAC) curvature factors of the configured model over its data."""
    from .curvature import fit_factors

    cfg = with_overrides(load_config(config), device=device, batch_size=batch_size, limit=limit)
    with terminal.progress("factors") as (on_start, on_batch):
        made = fit_factors(
            cfg,
            out,
            ekfac=ekfac,
            fisher=fisher,
            trust_checkpoint=trust_checkpoint,
            on_start=on_start,
            on_batch=on_batch,
        )
    kinds = [b["kind"] for b in made.describe().values()]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    left = made.meta["left_out"]
    left = f" ({left} left out: a NaN or infinite loss or gradient)" if left else ""
    terminal.console.print(
        f"{made.meta['examples']} examples{left}, {made.meta['fisher']} Fisher; {counts}"
    )
    terminal.wrote(out)


@app.command()
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
    from .index.layout import described
    from .index.scorer import IndexScorer, index_output
    from .run import score_dataset

    cfg = with_overrides(load_config(config), device=device, batch_size=batch_size, limit=limit)
    cfg = index_output(cfg, out)
    scorer = IndexScorer(dim, seed, storage)
    with terminal.progress("index") as (on_start, on_batch):
        path = score_dataset(
            cfg, scorer, trust_checkpoint=trust_checkpoint, resume=resume,
            on_start=on_start, on_batch=on_batch,
        )  # fmt: skip
    if path is not None:  # rank 0 under torchrun
        terminal.console.print(described(path))
        terminal.wrote(path)


@app.command()
def query(
    index: Annotated[
        Path, typer.Argument(metavar="INDEX", help="An index folder written by gradscope index.")
    ],
    ref: Annotated[
        str,
        typer.Option(
            "--ref",
            metavar="REF",
            help="Reference data (any format data.path takes); same columns.",
        ),
    ],
    per_ref: Annotated[
        bool, typer.Option("--per-ref", help="Every REF row its own reference: its top-k.")
    ] = False,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            metavar="K",
            help="Rows per reference (default: every example for the "
            "mean reference, else summary.top_k).",
        ),
    ] = None,  # fmt: skip
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Re-score each reference's top k * M candidates with the "
            "exact engine and rank by the exact scores.",
        ),
    ] = False,  # fmt: skip
    candidates: Annotated[
        int | None,
        typer.Option(
            "--candidates",
            metavar="M",
            help="M of --exact: candidates per top-k row (default 30).",
        ),
    ] = None,
    normalize: Annotated[
        bool, typer.Option("--normalize", help="Cosine: unit-normalised gradients.")
    ] = False,
    precondition: Annotated[
        Path | None,
        typer.Option(
            "--precondition",
            metavar="FILE",
            help="Factors file or Adam/AdamW state_dict, applied to the references.",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", metavar="PATH", help="Parquet file to write (default: INDEX.query.parquet)."
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="CONFIG",
            help="The indexed model's config, for an index that holds none.",
        ),
    ] = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Score every indexed example against the gradients of REF (their mean, or each row)."""
    from .index.query import CANDIDATES, Query, run_query, shown

    _check_top_k(top_k)
    asked = Query(
        ref if ".py:" in ref else str(Path(ref).resolve()), per_ref, top_k, exact,
        CANDIDATES if candidates is None else candidates, normalize,
        str(precondition.resolve()) if precondition else None,
    )  # fmt: skip
    path = run_query(
        index, asked, out, config=config, device=device, batch_size=batch_size,
        trust_checkpoint=trust_checkpoint,
    )  # fmt: skip
    terminal.console.print(shown(path, top_k or SummaryConfig.top_k))
    terminal.wrote(path)


def _padding(cfg: Config) -> str:
    """``data.pad`` as the run uses it; a value that is the default for its column is marked."""
    from .config import default_pad

    defaults = default_pad(cfg)
    return "padding: " + ", ".join(
        f"{name} {value:g}" + (" (default)" if defaults.get(name) == value else "")
        for name, value in cfg.data.pad.items()
    )


ScoresArg = Annotated[
    Path, typer.Argument(metavar="SCORES", help="A Parquet file written by gradscope.")
]


@app.command()
def summary(scores: ScoresArg, by: ByOpt = None, top_k: TopKOpt = None) -> None:
    """Print the outlier tables of an existing scores file (20 rows unless --top-k)."""
    from .errors import DataError

    if not scores.is_file():
        raise DataError("scores file not found", str(scores))
    _check_top_k(top_k)
    _summary(scores, by, top_k or SummaryConfig.top_k)


@app.command()
def report(
    scores: ScoresArg,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="CONFIG",
            help="The run's config: the top-k examples are read and shown.",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("--out", metavar="PATH", help="HTML file to write (default: SCORES.html)."),
    ] = None,
    by: ByOpt = None,
    top_k: TopKOpt = None,
) -> None:
    """Write one self-contained HTML page: charts of the scores, the top-k examples shown
    (--top-k, else the config's summary.top_k, else 20)."""
    _check_top_k(top_k)
    cfg = load_config(config) if config else None
    target = Path(output_path(out, Path.cwd(), "--out")) if out is not None else None
    _write_report(scores, target, cfg, by, top_k or (cfg.summary if cfg else SummaryConfig).top_k)


def _check_top_k(top_k: int | None) -> None:
    from .errors import ConfigError

    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be at least 1, got {top_k}", "--top-k")


def main() -> None:
    for stream in (sys.stdout, sys.stderr):  # a locale that cannot show a character: '?', not
        if hasattr(stream, "reconfigure"):  # a traceback (the histogram's bars, a path's é)
            stream.reconfigure(errors="replace")
    app()
