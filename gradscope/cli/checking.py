"""``gradscope check``: both engines against a per-example loop on the first examples, with
the plan each parameter follows and the padding the run uses."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import terminal
from ..config import Config, load_config, with_overrides
from .options import ConfigArg, DeviceOpt, TrustOpt, ref_option


def check(
    config: ConfigArg,
    examples: Annotated[
        int, typer.Option("--examples", metavar="N", help="Compare on the first N examples.")
    ] = 8,
    ref: ref_option(
        "Reference data for the influence check (default: the examples).", required=False
    ) = None,
    device: DeviceOpt = None,
    trust_checkpoint: TrustOpt = False,
) -> None:
    """Compare both engines with a per-example backward loop; exit 1 above tolerance."""
    from ..engine import render_plan, render_report
    from ..job import check_config

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


def _padding(cfg: Config) -> str:
    """``data.pad`` as the run uses it; a value that is the default for its column is marked."""
    from ..config import default_pad

    defaults = default_pad(cfg)
    shown = [
        f"{name} {value:g}" + (" (default)" if defaults.get(name) == value else "")
        for name, value in cfg.data.pad.items()
    ]
    targets = cfg.data.pad_targets
    return "padding: " + ", ".join(
        shown + ([f"targets {targets:g}"] if targets is not None else [])
    )
