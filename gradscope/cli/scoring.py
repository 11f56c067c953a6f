"""The commands that run the configured model over its data: ``norms``, ``influence`` and
``factors`` (``check``: ``checking.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .. import terminal
from ..config import Config, load_config, with_overrides
from ..defaults import CG_TOLERANCE, CURVATURE, DAMPING
from ..errors import Interrupted
from .options import (
    BatchOpt,
    ByOpt,
    ConfigArg,
    DeviceOpt,
    LimitOpt,
    OutOpt,
    ReportOpt,
    ResumeOpt,
    TopKOpt,
    TrustOpt,
    precondition_option,
    ref_option,
)
from .reports import print_tables, write_html

if TYPE_CHECKING:  # the scorers import torch: not for --help, --version, summary
    from ..scorers import Scorer


PerRefOpt = Annotated[
    bool, typer.Option("--per-ref", help="One row per (example, reference example) pair, ref_id.")
]
EngineOpt = Annotated[
    str,
    typer.Option(
        "--engine",
        metavar="auto|hooks|jvp",
        help="auto, hooks (ghost inner products) or jvp (forward mode).",
    ),
]
CurvatureOpt = Annotated[
    str | None,
    typer.Option(
        "--curvature",
        metavar="none|gn|hessian|kfac|ekfac",
        help="Score against (C + lambda I)^-1 g_ref, C fitted over the config's data in this "
        "run: gn (Gauss-Newton) or hessian exactly, kfac or ekfac factored; none: g_ref "
        f"(default: {CURVATURE}; none with --precondition).",
    ),
]
DampingOpt = Annotated[
    float | None,
    typer.Option(
        "--damping",
        metavar="X",
        help="lambda = X times the curvature's mean eigenvalue (K-FAC: of each factor's; "
        "--solver cg: its estimate from random probes; one of 0 or below is refused); default "
        + ", ".join(f"{v:g} for {k}" for k, v in DAMPING.items())
        + ".",
    ),
]
SolverOpt = Annotated[
    str,
    typer.Option(
        "--solver",
        metavar="auto|dense|cg",
        help="gn/hessian: dense (the P x P matrix, a Cholesky factor), cg (conjugate "
        "gradients), auto: dense where the matrix fits 2 GiB.",
    ),
]
CGToleranceOpt = Annotated[
    float,
    typer.Option(
        "--cg-tolerance",
        metavar="X",
        help="Conjugate gradients stop once each reference's relative residual "
        "||b - (C + lambda I) x|| / ||b|| is at most X, in (0, 1), the true one checked after "
        "(an error where it stays over); the residual reached is in the file's metadata.",
    ),
]
ThroughTrainingOpt = Annotated[
    Path | None,
    typer.Option(
        "--through-training",
        metavar="RUN",
        help="A run record (gradscope train --record): score by replaying the run backward, "
        "d(REF loss)/d(example weight) through every step (no --curvature).",
    ),
]


def note_weights(cfg: Config) -> None:
    """After a run, a note where no file gave the model its weights: they were the factory's."""
    model = cfg.model
    if model.checkpoint is None and not model.checkpoints and model.pretrained is None:
        terminal.note(
            "the config names no checkpoint (model.checkpoint, model.checkpoints or "
            "model.pretrained): the model was scored with the weights model.factory gives it "
            "(initialised under seed 0)"
        )


def scored(cfg: Config, scorer: Scorer, trust_checkpoint: bool, resume: bool) -> Path | None:
    """A scoring run under a progress bar: the file it wrote (None on the ranks other than 0
    under torchrun)."""
    from ..run import score_dataset

    with terminal.progress(scorer.command) as (on_start, on_batch):
        return score_dataset(
            cfg, scorer, trust_checkpoint=trust_checkpoint, resume=resume,
            on_start=on_start, on_batch=on_batch,
        )  # fmt: skip


def _run(
    cfg: Config, scorer: Scorer, by: str | None, report: bool, trust_checkpoint: bool, resume: bool
) -> None:
    """A scoring run under a progress bar, then the file it wrote, its outlier tables and, if
    asked, its report (on rank 0 only)."""
    from ..outliers import check_by

    check_by(by, scorer.names(cfg))  # a bad --by fails before the run, not after it
    if report:  # and a report that could not be written (it was: after the scores)
        from ..report import check_report

        check_report(cfg)
    path = scored(cfg, scorer, trust_checkpoint, resume)
    if path is None:  # on the ranks other than 0 under torchrun
        return
    try:
        try:
            print_tables(path, by, cfg.summary.top_k, cfg.data.classes)
        finally:  # the scores are written whatever the tables make of them
            terminal.wrote(path)
        if report:
            write_html(path, None, cfg, by, cfg.summary.top_k)
    except KeyboardInterrupt:  # the scores are whole: not "before any example was saved"
        raise Interrupted("interrupted after every example was saved", str(path)) from None


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
    precondition: precondition_option(
        "adds self_influence = g^T P g, P the inverse curvature or 1 / (sqrt(v_hat) + eps)."
    ) = None,
    resume: ResumeOpt = False,
    trust_checkpoint: TrustOpt = False,
    report: ReportOpt = False,
) -> None:
    """L2 norm of each example's own loss gradient."""
    from ..scorers import NormsScorer

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
    note_weights(cfg)


def influence(
    config: ConfigArg,
    ref: ref_option("Reference data file (any format data.path takes); same column names."),
    out: OutOpt = None,
    device: DeviceOpt = None,
    batch_size: BatchOpt = None,
    limit: LimitOpt = None,
    top_k: TopKOpt = None,
    per_ref: PerRefOpt = False,
    precondition: precondition_option(
        "score against P g_ref, P the inverse curvature or 1 / (sqrt(v_hat) + eps)."
    ) = None,
    engine: EngineOpt = "auto",
    curvature: CurvatureOpt = None,
    damping: DampingOpt = None,
    solver: SolverOpt = "auto",
    cg_tolerance: CGToleranceOpt = CG_TOLERANCE,
    through_training: ThroughTrainingOpt = None,
    by: ByOpt = None,
    resume: ResumeOpt = False,
    trust_checkpoint: TrustOpt = False,
    report: ReportOpt = False,
) -> None:
    """Inner product of each example's loss gradient with the mean-loss gradient over REF."""
    from ..scorers import InfluenceScorer

    cfg = with_overrides(
        load_config(config),
        out=out,
        device=device,
        batch_size=batch_size,
        limit=limit,
        top_k=top_k,
    )
    if through_training is not None:  # the replay trains by the config, as the run did
        from ..training.attribution import at_record, replayed, unread

        trained = with_overrides(load_config(config), out=out, device=device)
        given = unread(curvature, precondition, damping, solver, cg_tolerance, engine)
        scorer = replayed(trained, ref, through_training, per_ref, given, resume)
        return _run(at_record(cfg), scorer, by, report, trust_checkpoint, resume=False)
    scorer = InfluenceScorer(
        ref,
        per_ref=per_ref,
        precondition=precondition,
        engine=engine,
        trust_checkpoint=trust_checkpoint,
        curvature=curvature,
        damping=damping,
        solver=solver,
        cg_tolerance=cg_tolerance,
    )
    _run(cfg, scorer, by, report, trust_checkpoint, resume)
    note_weights(cfg)


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
    from ..curvature import fit_factors

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
    note_weights(cfg)
