"""The commands that read a scores file: ``summary`` (the outlier tables) and ``report``
(the HTML page); the scoring commands end with the same tables and page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import terminal
from ..config import Config, SummaryConfig, check_counts, load_config, output_path
from .options import ByOpt, ScoresArg, TopKOpt


def print_tables(path: Path, by: str | None, top_k: int, classes: list[str] | None = None) -> None:
    """The outlier tables of a scores file, on the terminal."""
    from ..summary import summarize

    terminal.console.print(summarize(path, by, top_k, classes))


def write_html(
    scores: Path, out: Path | None, cfg: Config | None, by: str | None, top_k: int
) -> None:
    """The HTML report of a scores file, written; its path on the terminal."""
    from ..report import write_report

    terminal.wrote(write_report(scores, out, cfg, by, top_k))


def summary(scores: ScoresArg, by: ByOpt = None, top_k: TopKOpt = None) -> None:
    """Print the outlier tables of an existing scores file (--top-k rows, else the scoring
    run's summary.top_k, else 20)."""
    from ..errors import INDEX_FOLDER, DataError, check_file
    from ..io.parquet import nested, read_metadata

    check_file(scores, "scores file", DataError, INDEX_FOLDER)
    check_counts(top_k=top_k)
    kept = nested(read_metadata(scores), "config", "summary", "top_k")  # full metadata only
    kept = kept if isinstance(kept, int) and not isinstance(kept, bool) and kept >= 1 else None
    print_tables(scores, by, top_k or kept or SummaryConfig.top_k)


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
    check_counts(top_k=top_k)
    cfg = load_config(config) if config else None
    target = Path(output_path(out, Path.cwd(), "--out")) if out is not None else None
    write_html(scores, target, cfg, by, top_k or (cfg.summary if cfg else SummaryConfig).top_k)
