"""The typer app and its one error boundary: where errors become exit codes, and the commands
that run a model log their start and end off a terminal."""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperGroup

from .. import terminal
from ..errors import GradscopeError, Interrupted

# transformers, when a config names it: no "Loading weights" bar, no advice on every run
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not os.environ.get("GRADSCOPE_DEBUG"):  # torch's C++ log lines (c10d's retries print stacks)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


# commands that run a model over data
LOGGED = ("norms", "influence", "factors", "check", "train", "validate")


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
        from .. import __version__

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
